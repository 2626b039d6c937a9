"""Per-request sampling settings and the statistics returned with each output."""
from __future__ import annotations

import math
import numbers
from dataclasses import InitVar, dataclass, field

VERIFY_MODES = ("fixed", "threshold", "scheduled")        # = confidence.VERIFY_MODES
MAX_LOGPROBS = 20                                         # = logprobs.MAX_LOGPROBS (OpenAI's cap)


class RequestError(ValueError):
    """A request is invalid (the message names the field); other requests are unaffected."""


@dataclass
class SamplingParams:
    temperature: float = 0.0            # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 64            # also settable as ``max_tokens`` (vLLM's name)
    seed: int | None = None             # None: drawn at admission
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # how many of the N drafts a round verifies (runtime/confidence.py): "fixed" (all N),
    # "threshold" (before the first raw confidence < confidence_threshold, DeepSpec), "scheduled"
    # (the paper's load-aware Algorithm 1); the last two need a draft with a confidence head
    verify_mode: str = "fixed"
    confidence_threshold: float = 0.5
    # modifiers of the target distribution (vLLM semantics; runtime/sampling_modifiers.py)
    top_k: int = -1                     # keep the k most likely tokens (-1 or 0: off)
    min_p: float = 0.0                  # drop tokens below min_p x the top probability (0: off)
    presence_penalty: float = 0.0       # logit -= presence x (token in the output), in [-2, 2]
    frequency_penalty: float = 0.0      # logit -= frequency x (its count in the output), in [-2, 2]
    repetition_penalty: float = 1.0     # tokens in prompt or output: logit / r if > 0, else x r
    # per emitted token: its raw target logprob and the ``logprobs`` most likely tokens' (None:
    # none; 0: only the token's own; at most logprobs.MAX_LOGPROBS; runtime/logprobs.py)
    logprobs: int | None = None
    max_tokens: InitVar[int | None] = None   # an alias of max_new_tokens: given, it sets it

    def __post_init__(self, max_tokens):
        if max_tokens is not None:
            self.max_new_tokens = max_tokens

    def validate(self) -> "SamplingParams":
        """Raise ``RequestError`` (a ``ValueError``) naming the first invalid field; -> self."""
        if not _is_int(self.max_new_tokens) or self.max_new_tokens <= 0:
            raise RequestError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or not (0 <= self.temperature < math.inf):
            raise RequestError(f"temperature must be >= 0 and finite (0 = greedy), got "
                               f"{self.temperature!r}")
        if not _is_real(self.top_p) or not (0 < self.top_p <= 1):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise RequestError(f"top_k must be an integer >= 1, or -1 / 0 (off), got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise RequestError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_real(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise RequestError(f"repetition_penalty must be > 0 and finite (1 = off), got "
                               f"{self.repetition_penalty!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**63):
            raise RequestError(f"seed must be in [0, 2**63) (an integer), got {self.seed!r}")
        if self.verify_mode not in VERIFY_MODES:
            raise RequestError(f"verify_mode must be one of {', '.join(VERIFY_MODES)}, got "
                               f"{self.verify_mode!r}")
        if not _is_real(self.confidence_threshold) or not 0 <= self.confidence_threshold <= 1:
            raise RequestError(f"confidence_threshold must be in [0, 1], got {self.confidence_threshold!r}")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (or None), got "
                               f"{self.logprobs!r}")
        bad = [t for t in self.stop_token_ids if not _is_int(t) or t < 0]
        if bad:
            raise RequestError(f"stop_token_ids must be non-negative integers, got {bad[0]!r}")
        return self


SamplingParams.max_tokens = property(                       # vLLM's name, read and written
    lambda self: self.max_new_tokens, lambda self, v: setattr(self, "max_new_tokens", v))


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass
class SpecStats:
    """Speculative statistics (DeepSpec definitions, algorithm doc §4.2), one entry per round.

    ``accepted[i]``: drafts of round i that the verifier accepted and the request committed;
    ``committed[i]``: tokens round i committed, bonus / correction token included;
    ``proposed[i]``: the round's proposal length (the drafts it verified: N, or the admitted
    length under a confidence mode, or where the round was cut).
    A round cut by a stop token (or the length limit) inside the accepted drafts commits the
    drafts up to and including it and no bonus, and its proposal length is cut there (DeepSpec's
    ``metrics_row``). tau = mean(committed), so 1 <= tau <= N + 1.
    """

    num_spec_tokens: int = 0
    accepted: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)

    def record(self, accepted: int, committed: int, proposed: int | None = None) -> None:
        """One round: the verifier accepted ``accepted`` of ``proposed`` (default N) verified
        drafts and the request committed ``committed`` tokens (fewer than accepted + 1 when a stop
        token or the length cut it)."""
        if committed > accepted:                        # the bonus / correction token was committed
            self.accepted.append(accepted)
            self.proposed.append(self.num_spec_tokens if proposed is None else proposed)
        else:                                           # cut inside the accepted drafts
            self.accepted.append(committed)
            self.proposed.append(committed)
        self.committed.append(committed)

    @property
    def rounds(self) -> int:
        return len(self.committed)

    @property
    def tau(self) -> float:
        return sum(self.committed) / self.rounds if self.rounds else 0.0

    def acceptance_per_position(self) -> list[float]:
        """Position k: rounds with >= k+1 accepted drafts / rounds whose proposal reached k."""
        rates = []
        for k in range(self.num_spec_tokens):
            reached = sum(p > k for p in self.proposed)
            rates.append(sum(a > k for a in self.accepted) / reached if reached else 0.0)
        return rates

    def merge(self, other: "SpecStats") -> "SpecStats":
        return SpecStats(max(self.num_spec_tokens, other.num_spec_tokens), self.accepted + other.accepted,
                         self.committed + other.committed, self.proposed + other.proposed)

    @property
    def verified_per_round(self) -> float:
        """Mean tokens verified per round (admitted drafts + the anchor row)."""
        return sum(self.proposed) / self.rounds + 1 if self.rounds else 0.0

    @property
    def admitted_acceptance(self) -> float:
        """Accepted drafts / verified drafts."""
        n = sum(self.proposed)
        return sum(self.accepted) / n if n else 0.0

    def to_dict(self) -> dict:
        return {"rounds": self.rounds, "tau": self.tau, "num_spec_tokens": self.num_spec_tokens,
                "acceptance_per_position": self.acceptance_per_position(),
                "verified_per_round": self.verified_per_round,
                "admitted_acceptance": self.admitted_acceptance}


@dataclass
class RequestOutput:
    request_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str                  # "stop" | "length" | "abort" | "error"
    stats: SpecStats
    text: str | None = None
    error: str | None = None            # why, when finish_reason is "error"
    logprobs: list | None = None        # one ``logprobs.TokenLogprob`` per output token, if asked


@dataclass
class StreamChunk:
    """New tokens of one request of a batch, as a round commits them.

    ``index`` is the request's place in the prompt list; ``finish_reason`` is set on the request's
    last chunk ("stop" | "length" | "abort" | "error") and None before it; ``error`` says why
    when it is "error".
    """

    index: int
    request_id: int
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
