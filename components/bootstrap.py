"""Bootstrap SFT: teach a randomly initialized policy the tasks' answer format
and some of their answers, so that RL starts from partial accuracy.

GRPO learns nothing from a group whose rewards are all 0, and a policy with
seeded random weights scores 0 on every task; one already at the ceiling
leaves RL nothing to show. ``bootstrap`` trains the policy in place on the
teacher-forced loss of the answer after the prompt, laid out exactly as the
rollout engine sees it (the prompt as the tokenizer encodes it, through the
chat template when there is one, then the answer through its end: the
end-of-turn eos, or a plain tokenizer's newline), and can stop early once the
greedy test accuracy, measured with the real rollout engine, reaches a target
below the ceiling.
Seeded: the same seed gives the same weights.
"""

import logging
import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from .model import Transformer, right_pad
from .rl import token_logprobs
from .rollout import SamplingParams, TorchEngine
from .tasks import Problem, format_example, reward_of, solved
from .tokenizer import PolicyTokenizer
from .trainer import clip_gradients

# one line per step, "bootstrap step i/n ...": the local runner's progress bar reads it from the component log
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BootstrapConfig:
    """SFT hyperparameters. The defaults take the ``tiny`` preset to 34-47%
    greedy test accuracy on arithmetic difficulty 1 (256 train problems) in
    about 30 s on 2 CPU cores (60 s of CPU time)."""

    steps: int = 300
    batch_size: int = 32
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup: int = 30  # linear warmup steps, then cosine decay to 0 at ``steps``
    grad_clip: float = 1.0
    seed: int = 0
    max_len: int = 128  # longest prompt + target in tokens; a longer example is an error
    target_accuracy: float | None = None  # stop once the greedy accuracy on the check problems reaches it
    eval_every: int = 50  # steps between accuracy checks on the check problems (0: none)
    max_new_tokens: int = 32
    compute_dtype: torch.dtype = torch.float32  # bfloat16: BF16 autocast over the float32 weights

    def __post_init__(self):
        if (
            min(self.steps, self.batch_size, self.max_len, self.max_new_tokens) < 1
            or min(self.warmup, self.eval_every) < 0
        ):
            raise ValueError(f"invalid bootstrap config {self}")
        if self.target_accuracy is not None and not (0 < self.target_accuracy <= 1 and self.eval_every > 0):
            raise ValueError("target_accuracy must lie in (0, 1] and needs eval_every > 0")


@dataclass
class SFTBatch:
    """Examples right-padded (with the tokenizer's pad id) into ``tokens [B, S]``;
    column t of ``target [B, S-1]`` is True where token t+1 belongs to the
    target (the answer through its end), the only positions that carry loss."""

    tokens: Tensor
    positions: Tensor
    lengths: Tensor
    target: Tensor


def prompt_ids(tokenizer: PolicyTokenizer, problem: Problem) -> list[int]:
    """The prompt as the pipeline's rollout encodes it."""
    return tokenizer.encode_prompt(format_example(problem))


class ExampleTooLong(ValueError):
    """A bootstrap example (prompt and answer) longer than ``max_len``."""


def make_batch(tokenizer: PolicyTokenizer, problems: list[Problem], max_len: int, device="cpu") -> SFTBatch:
    """Prompt + answer (through its end) per problem, the answer marked as target."""
    examples = []
    for p in problems:
        prompt, target = prompt_ids(tokenizer, p), tokenizer.encode_answer(p.answer)
        if len(prompt) + len(target) > max_len:
            length = len(prompt) + len(target)
            raise ExampleTooLong(f"a {p.task} example of {length} tokens (prompt and answer) exceeds max_len {max_len}")
        examples.append((prompt, target))
    tokens, positions, lengths = right_pad([prompt + answer for prompt, answer in examples], pad=tokenizer.pad_id)
    target = torch.zeros(tokens.shape[0], tokens.shape[1] - 1, dtype=torch.bool)
    for i, (prompt, answer) in enumerate(examples):
        target[i, len(prompt) - 1 : len(prompt) + len(answer) - 1] = True
    return SFTBatch(*(x.to(device) for x in (tokens, positions, lengths, target)))


def sft_loss(model: Transformer, batch: SFTBatch) -> Tensor:
    """Mean cross-entropy over the target tokens (their log-probabilities as RL's, :func:`.rl.token_logprobs`)."""
    return -(token_logprobs(model, batch) * batch.target).sum() / batch.target.sum()


def accuracy(
    model: Transformer, tokenizer: PolicyTokenizer, problems: list[Problem], max_new_tokens: int = 32
) -> float:
    """Greedy pass@1 through the rollout engine (float32, no quantization): the share of ``problems`` solved
    (:func:`.tasks.solved` by each task's reward)."""
    device = next(model.parameters()).device
    engine = TorchEngine(model, dtype=torch.float32, device=device)
    sampling = SamplingParams(
        temperature=0.0, max_new_tokens=max_new_tokens, stop_tokens=tokenizer.stop_ids, pad_token=tokenizer.pad_id
    )
    responses = engine.generate([prompt_ids(tokenizer, p) for p in problems], sampling)
    rewards = [reward_of(p, tokenizer.response_text(t.response), t.finished) for t, p in zip(responses, problems)]
    return sum(map(solved, rewards)) / len(problems)


def bootstrap(
    model: Transformer,
    tokenizer: PolicyTokenizer,
    train: list[Problem],
    checks: list[Problem],
    test: list[Problem],
    config: BootstrapConfig = BootstrapConfig(),
) -> dict:
    """Train ``model`` in place on ``train``; returns the history: ``loss`` per
    step, ``evals`` (step, greedy accuracy on ``checks`` every ``eval_every``
    steps, which ``target_accuracy`` stops on), ``steps`` run,
    ``stopped_early``, ``seconds``, and ``accuracy`` (greedy, all of
    ``test``). The checks are problems of neither other list: a stop decided
    on test problems would favour the test set the accuracy is reported on."""
    if not train or not test:
        raise ValueError("bootstrap needs train and test problems")
    if 0 < config.eval_every < config.steps and not checks:
        raise ValueError(f"bootstrap checks accuracy every {config.eval_every} steps: it needs check problems")
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, the model only {model.cfg.vocab_size}")
    start = time.perf_counter()
    torch.manual_seed(config.seed)
    order = torch.Generator().manual_seed(config.seed)
    device = next(model.parameters()).device
    model.float().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)

    def schedule(step: int) -> float:
        if step < config.warmup:
            return (step + 1) / config.warmup
        return 0.5 * (1 + math.cos(math.pi * (step - config.warmup) / max(1, config.steps - config.warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    make_batch(tokenizer, train, config.max_len)  # every example fits, checked before training starts
    history = {"loss": [], "evals": [], "stopped_early": False}
    queue: list[int] = []
    for step in range(config.steps):
        while len(queue) < config.batch_size:  # epochs of a seeded permutation
            queue += torch.randperm(len(train), generator=order).tolist()
        chosen, queue = queue[: config.batch_size], queue[config.batch_size :]
        batch = make_batch(tokenizer, [train[i] for i in chosen], config.max_len, device)
        with torch.autocast(device.type, config.compute_dtype, enabled=config.compute_dtype != torch.float32):
            loss = sft_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip_gradients(model.parameters(), config.grad_clip)
        optimizer.step()
        scheduler.step()
        history["loss"].append(loss.item())
        log.info("bootstrap step %d/%d, loss %.4f", step + 1, config.steps, history["loss"][-1])
        if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < config.steps:
            acc = accuracy(model, tokenizer, checks, config.max_new_tokens)
            history["evals"].append({"step": step + 1, "accuracy": acc})
            log.info("bootstrap step %d: greedy accuracy %.3f on %d check problems", step + 1, acc, len(checks))
            if config.target_accuracy is not None and acc >= config.target_accuracy:
                history["stopped_early"] = True
                break
    history["steps"] = len(history["loss"])
    history["accuracy"] = accuracy(model, tokenizer, test, config.max_new_tokens)
    history["seconds"] = time.perf_counter() - start
    return history
