"""Verifiable token tasks for the token MDP, each a finite automaton read over the response.

A task is a prompt (one token naming the instance), a transition table over a small set of
hidden automaton states, and an acceptance table checked when the agent emits EOS. Everything
is a table lookup, so the scalar env, the vector env and the policies' state encoder run the
same rules with numpy or torch alike.

Tasks (``TASKS`` registry):

* ``sum`` — reach a target sum. Prompt c ∈ [0, m). Token 0 is EOS; token i ≥ 1 has value
  i mod m (many synonyms per value, as in an LLM vocabulary). Accepted iff the answer is
  non-empty and its values sum to c modulo m. A uniform guess succeeds 1/m of the time; the
  policy must learn, per (target, running sum, position), which tokens finish the job.
* ``grammar`` — follow a hidden grammar. Prompt q₀ ∈ [0, Q) is the start state of a random
  DFA over token classes (i mod C for i ≥ 1); a forbidden class sends the DFA to a dead state.
  Accepted iff the answer has at least ``min_len`` tokens and the DFA ends in an accepting
  state.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdm_lab.config import ConfigError, one_of

EOS = 0


@dataclass(frozen=True)
class AutomatonTask:
    """A token task as an automaton (see module docstring).

    Attributes:
        name: registry name.
        vocab_size: n, token ids [0, n); id 0 is EOS.
        max_len: L, the response budget (tokens, EOS included).
        num_prompts: how many distinct prompt tokens there are.
        start: [num_prompts] int64 automaton state at the start of the response.
        transition: [Q, n] int64 next state after emitting a token (EOS leaves it unchanged).
        accept: [num_prompts, Q] bool, accepted if EOS is emitted in that state.
        min_len: answers shorter than this (EOS excluded) are rejected.
    """

    name: str
    vocab_size: int
    max_len: int
    num_prompts: int
    start: np.ndarray
    transition: np.ndarray
    accept: np.ndarray
    min_len: int = 1
    prompt_class: np.ndarray | None = None
    """[num_prompts] int64: prompts that are paraphrases of one instance share a class (the
    automaton's sufficient statistic); None: every prompt is its own class."""

    @property
    def classes(self) -> np.ndarray:
        """[num_prompts] int64 class of each prompt (identity without paraphrases)."""
        return np.arange(self.num_prompts) if self.prompt_class is None else self.prompt_class

    @property
    def num_classes(self) -> int:
        return int(self.classes.max()) + 1

    @property
    def num_states(self) -> int:
        """Q, the automaton's state count."""
        return self.transition.shape[0]

    @property
    def pad(self) -> int:
        """The padding id used in observations for response slots not yet written (= n)."""
        return self.vocab_size

    @property
    def obs_len(self) -> int:
        """Observation length: one prompt token then L response slots."""
        return 1 + self.max_len


def target_sum_task(vocab_size: int = 128, modulus: int = 8, max_len: int = 6,
                    paraphrases: int = 1) -> AutomatonTask:
    """The ``sum`` task: answer tokens whose values (id mod m) sum to the prompt c mod m.

    ``paraphrases`` p > 1 gives m·p prompt tokens, prompt c asking for the target c mod m: many
    distinct contexts for the same instance, as an LLM's prompt set has."""
    if vocab_size < modulus + 1:
        raise ConfigError(f"vocab_size ({vocab_size}) must exceed modulus ({modulus})")
    if max_len < 2:
        raise ConfigError(f"max_len must be ≥ 2 (one answer token and EOS), got {max_len}")
    values = np.arange(vocab_size) % modulus
    state = np.arange(modulus)[:, None]
    transition = (state + values[None, :]) % modulus
    transition[:, EOS] = state[:, 0]
    if paraphrases < 1:
        raise ValueError(f"paraphrases must be ≥ 1, got {paraphrases}")
    prompts = modulus * paraphrases
    target = np.arange(prompts, dtype=np.int64) % modulus
    accept = target[:, None] == np.arange(modulus)[None, :]  # accept[c, s] = (s == c mod m)
    return AutomatonTask(name="sum", vocab_size=vocab_size, max_len=max_len,
                         num_prompts=prompts, start=np.zeros(prompts, dtype=np.int64),
                         transition=transition.astype(np.int64), accept=accept, min_len=1,
                         prompt_class=None if paraphrases == 1 else target)


def grammar_task(vocab_size: int = 128, num_states: int = 4, num_classes: int = 4,
                 max_len: int = 6, min_len: int = 3, allowed: float = 0.6,
                 task_seed: int = 0) -> AutomatonTask:
    """The ``grammar`` task: a random DFA (seeded by ``task_seed``) over token classes."""
    rng = np.random.default_rng(task_seed)
    dead = num_states
    classes = np.arange(vocab_size) % num_classes
    table = rng.integers(0, num_states, size=(num_states, num_classes))
    forbidden = rng.random((num_states, num_classes)) > allowed
    forbidden[np.arange(num_states), rng.integers(0, num_classes, num_states)] = False  # never stuck
    table = np.where(forbidden, dead, table)
    transition = np.full((num_states + 1, vocab_size), dead, dtype=np.int64)
    transition[:num_states] = table[:, classes]
    transition[:, EOS] = np.arange(num_states + 1)
    accepting = np.zeros(num_states + 1, dtype=bool)
    accepting[rng.permutation(num_states)[: max(1, num_states // 2)]] = True
    return AutomatonTask(name="grammar", vocab_size=vocab_size, max_len=max_len,
                         num_prompts=num_states, start=np.arange(num_states, dtype=np.int64),
                         transition=transition, accept=np.tile(accepting, (num_states, 1)),
                         min_len=min_len)


TASKS = {"sum": target_sum_task, "grammar": grammar_task}


def make_task(name: str = "sum", **kwargs) -> AutomatonTask:
    """Build a registered task by name; unknown names raise with the valid list."""
    one_of("task", name, TASKS)
    return TASKS[name](**kwargs)
