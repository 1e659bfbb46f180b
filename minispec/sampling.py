"""Sampling basics: logits -> probabilities with temperature, top-k and top-p.

Every distribution minispec verifies against is formed here, the target's ``p`` and the
draft's ``q`` alike, so that truncation (top-k / top-p) is applied identically to both.
Speculative sampling is exact for the *processed* target distribution: the output of a
speculative step has the same law as sampling one token from ``probs(target_logits, params)``.

References:
    Holtzman et al., "The Curious Case of Neural Text Degeneration" (2019), top-p / nucleus.
    Leviathan et al., "Fast Inference from Transformers via Speculative Decoding" (2023).
    Chen et al., "Accelerating LLM Decoding with Speculative Sampling" (2023).

Notation: ``p`` target distribution, ``q`` draft distribution, both [..., V].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into a distribution.

    Args:
        temperature: 0 means greedy (the distribution is one-hot on the argmax); > 0 divides
            the logits before the softmax.
        top_k: keep the k most likely tokens; 0 keeps all.
        top_p: keep the smallest set of most likely tokens whose mass reaches top_p
            (nucleus); 1.0 keeps all.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = no top-k), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = no nucleus truncation), got {p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


def as_params(params: SamplingParams | None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> SamplingParams:
    """The one ``SamplingParams`` of a call: ``params`` as given (built once by the caller), else one
    built, and so validated, from the three numbers; both at once is an error."""
    if params is None:
        return SamplingParams(temperature, top_k, top_p)
    if (temperature, top_k, top_p) != (0.0, 0, 1.0):
        raise TypeError("pass either params=SamplingParams(...) or temperature/top_k/top_p, not both")
    return params


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to logits; removed tokens get -inf.

    Args:
        logits: [..., V] raw logits.
        params: sampling parameters; must not be greedy.
    Returns:
        [..., V] processed logits (float32 or the input's float64).
    """
    if params.greedy:
        raise ValueError("process_logits needs temperature > 0; greedy has no logits to process")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(dtype) / params.temperature  # [..., V]
    V = x.shape[-1]
    if 0 < params.top_k < V:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        x = _nucleus(x, params.top_p)
    return x


def _nucleus(x: torch.Tensor, top_p: float, first: int = 64) -> torch.Tensor:
    """Top-p on processed logits x [..., V]: a token is kept while the mass of the tokens ranked before
    it is < top_p, so the most likely token always stays. The nucleus is found among the ``first``
    most likely tokens (``torch.topk``, sorted), 4x more while their mass stays below top_p, the
    whole vocabulary at worst: a nucleus of tens of tokens costs a top-k of 64 instead of a sort of
    all V (the decode loop takes top-p for every row it verifies and every draft it samples)."""
    V = x.shape[-1]
    lse = torch.logsumexp(x, dim=-1, keepdim=True)  # [..., 1]: the full softmax's normaliser
    m = min(first, V)
    while True:
        top_x, order = torch.topk(x, m, dim=-1)  # [..., m], most likely first
        top_p_sorted = torch.exp(top_x - lse)  # their probabilities under the full softmax
        mass = torch.cumsum(top_p_sorted, dim=-1)  # [..., m]
        if m == V or bool((mass[..., -1] >= top_p).all()):  # token m + 1 on has mass >= top_p before it
            break
        m = min(4 * m, V)
    keep_sorted = (mass - top_p_sorted) < top_p  # mass strictly before each of the m
    keep = torch.zeros(x.shape, dtype=torch.bool, device=x.device).scatter(-1, order, keep_sorted)
    return x.masked_fill(~keep, float("-inf"))


def probs(logits: torch.Tensor, params: SamplingParams | None = None, **kwargs) -> torch.Tensor:
    """Logits -> the distribution that sampling draws from (p for the target, q for a draft).

    Args:
        logits: [..., V] raw logits.
        params: a SamplingParams, or keyword arguments temperature/top_k/top_p.
    Returns:
        [..., V] probabilities summing to 1; one-hot on the argmax when greedy.
    """
    params = as_params(params, **kwargs)
    if params.greedy:
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        out = torch.zeros(logits.shape, dtype=dtype, device=logits.device)
        return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.softmax(process_logits(logits, params), dim=-1)


def draw_device(p: torch.Tensor, generator: torch.Generator | None) -> torch.device:
    """Where ``sample`` draws: on the generator's device (torch.multinomial needs the probabilities
    there), else on p's own (torch's default generator of that device)."""
    return generator.device if generator is not None else p.device


def sample(p: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row from a distribution, by inverse transform sampling: one uniform number u
    per row, and the first token whose cumulative weight (float64) exceeds u times the row's total.

    Exact up to float64 rounding of the cumulative sums. ``torch.multinomial`` draws one exponential
    number per token of the vocabulary instead (``docs/results.md`` has what that cost): a sampled
    speculative step draws once per draft token and once per verified position, so it paid that many
    times over.

    The draw happens on the generator's device (``draw_device``): with generate's CPU generator
    and probabilities on a GPU, the probabilities are copied to the CPU (V floats per row, as
    ``verify.TorchChooser`` does) and the token comes back to p's device, so a seed gives the same
    tokens from the same probabilities on any device. Only a GPU shows the copy's cost.

    Args:
        p: [..., V] non-negative weights (need not be normalised; each row must have some mass).
        generator: optional torch.Generator for reproducibility, on any device.
    Returns:
        [...] int64 token ids on p's device.
    """
    dev = draw_device(p, generator)
    flat = p.reshape(-1, p.shape[-1]).to(dev, torch.float64)  # [N, V]
    cdf = flat.cumsum(-1)  # [N, V]
    total = cdf[:, -1:]  # [N, 1]
    if not bool((total > 0).all()):
        raise ValueError("cannot sample from a distribution with no mass (all weights zero or negative)")
    u = torch.rand(flat.shape[0], 1, dtype=torch.float64, generator=generator, device=dev) * total  # [N, 1]
    ids = torch.searchsorted(cdf, u, right=True).clamp_max_(flat.shape[-1] - 1)  # first cdf > u: p(id) > 0
    return ids.to(p.device).reshape(p.shape[:-1])


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick the next token from logits [..., V]: argmax when greedy, else a sample from probs."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return sample(probs(logits, params), generator)
