"""Test helpers (a package: tests import them as ``tests.support.<module>``)."""
