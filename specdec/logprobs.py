"""Log-probabilities under the target: of each committed token (from a round's verify logits) and of a prompt's
tokens (``echo`` / ``prompt_logprobs``), with the most probable tokens at each position."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.target import Target


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the target, and the most probable tokens at its position."""

    token: int  # the token id
    logprob: float  # log p(token | prefix), the target's, after the logits processors in force
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability) of the most probable tokens, best first


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each of ``tokens``' log-probability under ``logits`` [n, V] (position i scores token i), with the ``top``
    most probable tokens of each position. In a round, position i is the target's own distribution there (after
    the processors, before temperature, top-k and top-p), whichever way the token came (an accepted draft, the
    recovered token at a rejection, the bonus): the figures are the target's alone, whatever the drafter proposed."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    ids = torch.tensor(tokens, dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(-1, ids[:, None])[:, 0].tolist()  # [n]
    if top <= 0:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
    values, indices = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)  # [n, top]
    return [TokenLogprob(t, lp, tuple(zip(i, v))) for t, lp, i, v in
            zip(tokens, chosen, indices.tolist(), values.tolist())]


SCORE_TOKENS = 8192  # prompt tokens (rows x the longest) scored in one forward: bounds its [B, T, V] logits


def prompt_logprobs(target: Target, prompts: list[list[int]], tops: list[int]) -> list[list[TokenLogprob | None]]:
    """Each prompt's tokens' log-probabilities under the target (the first token has none: None), with the
    ``tops[i]`` most probable tokens at each position: forwards over the prompts, right-padded (up to
    ``SCORE_TOKENS`` a forward), without a cache (a causal model's real positions see no padding). The raw
    distribution: no processor applies to a prompt, as ``generate`` applies none there. Decoder-only targets only."""
    if target.encoder_decoder:
        raise ValueError("prompt log-probabilities need a decoder-only target (an encoder-decoder's prompt is its "
                         "source, which it does not predict)")
    out: list[list[TokenLogprob | None]] = []
    start = 0
    while start < len(prompts):
        end = start + 1
        while end < len(prompts) and (end + 1 - start) * max(map(len, prompts[start:end + 1])) <= SCORE_TOKENS:
            end += 1
        group = prompts[start:end]
        longest = max(len(p) for p in group)
        ids = torch.zeros(len(group), longest, dtype=torch.long, device=target.device)  # [B, T]
        mask = torch.zeros_like(ids)
        for b, p in enumerate(group):
            ids[b, : len(p)] = torch.tensor(p, dtype=torch.long)
            mask[b, : len(p)] = 1
        with torch.inference_mode():
            logits = target.model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # [B, T, V]
        out += [[None, *token_logprobs(logits[b, : len(p) - 1], p[1:], top)] for b, (p, top) in
                enumerate(zip(group, tops[start:end]))]
        start = end
    return out
