"""Builder: checkpoint loading and name remaps, export, backends, engine directory format."""
