"""Beam search as Hugging Face ``generate(num_beams=k)`` does it, one step at a time.

Pure bookkeeping on the host; the engine turns each step's choice into scheduler actions
(a beam chosen once appends its token, chosen m times forks m - 1 children, not chosen is
dropped), so beams share their common prefix's blocks as in the paper's Fig. 9.

Per step: every running beam proposes its top ``2k`` next tokens; candidates are ranked by
accumulated log-probability. Among the ``2k`` best, those that end (EOS, or the length limit)
and rank in the top ``k`` become finished hypotheses scored ``logprob / length**length_penalty``;
the best ``k`` that do not end continue. The search stops when ``k`` hypotheses are finished
(early stopping), when no running beam can still beat the worst finished one (HF's default
heuristic), or when every candidate has ended.
"""

from __future__ import annotations

import dataclasses

_NEG = -1.0e9


@dataclasses.dataclass(frozen=True)
class Beam:
    """A running or finished hypothesis: generated ``tokens``, their summed log-probability;
    ``proposals``, per token, the (token, logprob) pairs its parent proposed at that step."""

    tokens: tuple[int, ...]
    logprob: float
    score: float = 0.0
    proposals: tuple[tuple[tuple[int, float], ...], ...] = ()


@dataclasses.dataclass(frozen=True)
class Choice:
    """A running beam for the next step: continue parent beam ``parent`` with ``token``."""

    parent: int
    token: int
    beam: Beam


@dataclasses.dataclass(frozen=True)
class BeamState:
    """Running beams (by position), the finished pool (best first), and whether to stop."""

    running: tuple[Beam, ...]
    finished: tuple[Beam, ...] = ()
    done: bool = False


def start(width: int) -> BeamState:
    """The state before the first step: one empty beam (the prompt); the others start unused."""
    return BeamState(running=(Beam((), 0.0),) + tuple(Beam((), _NEG) for _ in range(width - 1)))


def step(state: BeamState, proposals, *, width: int, eos_token_ids, ignore_eos: bool, max_tokens: int,
         length_penalty: float, early_stopping: bool | str = False) -> tuple[BeamState, tuple[Choice, ...]]:
    """Advance by one token.

    proposals[i]: the top (token, logprob) pairs of running beam i, best first, at least
    ``2 * width`` of them. Returns the new state and the running beams for the next step
    (empty when the search is done).
    """
    candidates = sorted(
        ((beam.logprob + logprob, i, token) for i, beam in enumerate(state.running) for token, logprob in proposals[i]),
        key=lambda c: -c[0],
    )[: 2 * width]
    generated = len(state.running[0].tokens) + 1
    finished, choices = list(state.finished), []
    pool_full = len(finished) >= width and early_stopping is True
    for rank, (logprob, parent, token) in enumerate(candidates):
        before = state.running[parent]
        beam = Beam(before.tokens + (token,), logprob, proposals=before.proposals + (tuple(proposals[parent]),))
        ends = generated >= max_tokens or (not ignore_eos and token in eos_token_ids)
        if ends:
            if rank < width and not pool_full and logprob > _NEG / 2:
                finished.append(dataclasses.replace(beam, score=logprob / generated**length_penalty))
        elif len(choices) < width:
            choices.append(Choice(parent, token, beam))
    finished = tuple(sorted(finished, key=lambda b: -b.score)[:width])
    running = tuple(choice.beam for choice in choices)
    done = not running or _stop(running, finished, width, generated, early_stopping, length_penalty, max_tokens)
    return BeamState(running, finished, done), () if done else tuple(choices)


def _stop(running, finished, width, generated, early_stopping, length_penalty, max_tokens) -> bool:
    """HF's stopping rule, evaluated after ``generated`` tokens."""
    if len(finished) < width:
        return False
    if early_stopping is True:
        return True
    length = max_tokens if early_stopping == "never" and length_penalty > 0 else generated
    best_running = max(beam.logprob for beam in running) / length**length_penalty
    return best_running <= min(beam.score for beam in finished)


def results(state: BeamState, width: int) -> tuple[Beam, ...]:
    """The best ``width`` hypotheses, best first (running beams fill in if too few finished)."""
    return state.finished[:width]
