"""TRL 1.16's LM heads against ours: the heads alone, and one optimizer step of each trainer.

Head cases (each in a fresh Python subprocess, so each peak is its own):

* ``trl_logprob``: ``trl.kernels.chunked_logprob.ChunkedLogProbFunction`` (log-probs and
  entropy, TRL's default tile), the head ``add_fused_lm_head`` installs;
* ``ak_logprob``: ``ak.linear_token_logprobs(..., return_entropy=True)``, what
  ``astrai_kernels.integrations.trl.install`` runs in its place;
* ``trl_divergence``: ``trl.kernels.chunked_divergence.ChunkedDivergenceFunction`` (generalized
  JSD, DistillationTrainer's head);
* ``ak_distill``: ``ak.linear_distill_loss`` (same divergence, ``reduction="sum"``).

A head run is the forward and ``backward()`` of the summed log-probs and entropy (or divergence)
of ``N`` rows, hidden ``H``, vocabulary ``V``, float32; after one warm-up run, ``seconds`` is
the fastest of ``repeats`` runs, ``peak_bytes`` the resident-set high-water mark during a run
above the resident set before it (``astrai_kernels.bench.peak``); ``gemm_floor_seconds`` is
the time of the three ``[N, H] x [H, V]``-sized matmuls of a forward + backward (the
divergence's floor is four of them: both heads' logits, the student's two gradients).

Trainer cases (``--trainers``, each trainer x head in a fresh subprocess): one optimizer step of
SFTTrainer, DPOTrainer, GRPOTrainer, KTOTrainer, RLOOTrainer and GKDTrainer on a random
one-layer Llama built from a config (hidden ``--model-hidden``, vocabulary ``--vocab``, so the
LM head dominates) with a word-level tokenizer of the same vocabulary, under TRL's default
config but float32 on the CPU, with nothing saved or reported, and GKD's ``lmbda=0`` (no random
draw of on-policy generation). Heads: ``trl`` (TRL's own), ``ak`` (``install(trainer)``) and,
for GRPO, ``ak_fused`` (``install(trainer, fused_loss=True)``, reported as unavailable where
``install`` has no such keyword or refuses it). Every sequence has ``--seq-len`` scored tokens
(SFT text, DPO/KTO completions, GRPO/RLOO ``max_completion_length``, GKD answer) after a
``--prompt-len`` prompt, ``--batch`` sequences a step (DPO: pairs). After one warm-up step,
``seconds`` is the fastest of ``repeats`` steps (``on_step_begin`` to ``on_step_end``: forward,
backward, optimizer step; GRPO and RLOO include their generation, also given alone as
``generation_seconds``) and ``peak_bytes`` the resident-set high-water mark during a step above
the resident set before it. ``head_rows`` counts the rows each step sent through the LM head,
with gradient and forward-only (reference / teacher), ``head_calls`` the calls of TRL's head
and of ours (so a case shows which head it ran): on the CPU TRL's fused head scores every
position (its compaction to labelled rows is for Triton devices), ours only labelled ones.

    python bench/bench_trl.py                      # heads (N=2048, H=1024) and all trainers
    python bench/bench_trl.py --no-heads --trainers sft,grpo --json bench/results/trl.json
    python bench/bench_trl.py --rows 256 --hidden 128 --vocab 4096 --seq-len 32   # a quick look
"""

import argparse
import contextlib
import functools
import inspect
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script: this checkout's package
    sys.path.insert(0, ROOT)

from astrai_kernels.bench.peak import PeakRss  # noqa: E402
from astrai_kernels.bench.step_cases import (  # noqa: E402
    add_step_arguments,
    best_of,
    run_in_fresh_processes,
    times,
    write_results,
)

CASES = ("trl_logprob", "ak_logprob", "trl_divergence", "ak_distill")
TRAINERS = ("sft", "dpo", "grpo", "kto", "rloo", "gkd")
# TRL's defaults except: float32 on the CPU, nothing saved or reported, a fixed seed
STEP_ARGS = dict(bf16=False, fp16=False, use_cpu=True, report_to=[], save_strategy="no",
                 disable_tqdm=True, seed=0, dataloader_num_workers=0)


def _inputs(rows, hidden, vocab, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    student = (torch.randn(rows, hidden, generator=g)).requires_grad_(True)
    weight = (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).requires_grad_(True)
    teacher = torch.randn(rows, hidden, generator=g)
    teacher_weight = torch.randn(vocab, hidden, generator=g) * hidden ** -0.5
    target = torch.randint(0, vocab, (rows,), generator=g)
    return student, weight, teacher, teacher_weight, target


def run_case(case, rows=2048, hidden=1024, vocab=32768, repeats=2, threads=1, seed=0):
    """One case in this process; returns its result dict."""
    import torch
    import trl

    import astrai_kernels as ak

    if threads:
        torch.set_num_threads(threads)
    student, weight, teacher, teacher_weight, target = _inputs(rows, hidden, vocab, seed)

    def run():
        if case == "trl_logprob":
            from trl.kernels.chunked_logprob import ChunkedLogProbFunction
            from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

            logp, entropy, *_ = ChunkedLogProbFunction.apply(
                student, weight, None, target, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0,
                ("log_probs", "entropy"))
            (logp.sum() + entropy.sum()).backward()
        elif case == "ak_logprob":
            logp, entropy = ak.linear_token_logprobs(student, weight, target,
                                                     return_entropy=True)
            (logp.sum() + entropy.sum()).backward()
        elif case == "trl_divergence":
            from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

            divergence, _ = ChunkedDivergenceFunction.apply(
                student, weight, None, teacher, teacher_weight, None, 0.5, 1.0)
            divergence.sum().backward()
        else:
            ak.linear_distill_loss(student, weight, teacher, teacher_weight, beta=0.5,
                                   reduction="sum").backward()
        student.grad = weight.grad = None

    def gemm_floor():
        with torch.no_grad():
            logits = student @ weight.t()
            logits @ weight
            logits.t() @ student

    measured = best_of(run, repeats)
    floor = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        gemm_floor()
        floor = min(floor, time.perf_counter() - start)
    return {"case": case, "rows": rows, "hidden": hidden, "vocab": vocab, **measured,
            "gemm_floor_seconds": floor, "threads": torch.get_num_threads(),
            "trl": trl.__version__}


def run_all(cases=CASES, timeout=1800, **shape):
    """Each case in a fresh subprocess; a list of result dicts."""
    options = [item for name, value in shape.items()
               for item in (f"--{name.replace('_', '-')}", value)]
    return run_in_fresh_processes([os.path.abspath(__file__)],
                                  [["--case", case, *options] for case in cases], timeout)


def format_table(results):
    mib = 1 << 20
    by_case = {r["case"]: r for r in results}
    lines = [f"{'case':<15} {'seconds':>9} {'x floor':>8} {'peak MiB':>9} {'TRL/this time':>13} "
             f"{'TRL/this peak':>13}"]
    for r in results:
        trl_case = {"ak_logprob": "trl_logprob", "ak_distill": "trl_divergence"}.get(r["case"])
        base = by_case.get(trl_case)
        time_ratio = times(base["seconds"], r["seconds"]) if base else ""
        peak_ratio = times(base["peak_bytes"], max(r["peak_bytes"], 1)) if base else ""
        # the divergence has four matmuls (both heads' logits, the student's two gradients)
        floor = r["gemm_floor_seconds"] * (4 / 3 if r["case"] in ("trl_divergence",
                                                                 "ak_distill") else 1)
        lines.append(f"{r['case']:<15} {r['seconds']:>9.3f} {r['seconds'] / floor:>8.2f} "
                     f"{r['peak_bytes'] / mib:>9.1f} {time_ratio:>13} {peak_ratio:>13}")
    return "\n".join(lines)


def trainer_heads(trainer):
    """The heads a trainer is measured with: TRL's, ``install``'s, and for GRPO ``install``'s
    with its fused loss."""
    return ("trl", "ak", "ak_fused") if trainer == "grpo" else ("trl", "ak")


def word_tokenizer(vocab):
    """A tokenizer of exactly ``vocab`` ids: ``<pad>``, ``<eos>``, ``<bos>``, then the words ``w3``
    ... ``w{vocab - 1}``, one token per whitespace-separated word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>",
                                        eos_token="<eos>", bos_token="<bos>")
    # GKD's collator renders conversations with it; a prompt's tokens prefix the whole's
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tokenizer


def random_llama(vocab, hidden, layers, positions, seed):
    """A random ``LlamaForCausalLM`` from a config, float32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=positions, pad_token_id=0, eos_token_id=1,
                         bos_token_id=2)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def distinct_words_reward(completions, **kwargs):
    """GRPO's and RLOO's reward: any deterministic function of the text serves the benchmark."""
    return [float(len(set(text.split())) % 5) for text in completions]


def _trainer_setup(trainer, examples, batch, prompt_len, seq_len, vocab, model_kwargs, seed):
    """``(trainer class, config class, config keywords, trainer keywords)`` of one trainer, its
    data ``examples`` rows of random words."""
    import torch
    import trl
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)

    def words(count):
        return " ".join(f"w{i}" for i in torch.randint(3, vocab, (count,), generator=gen).tolist())

    def column(count):
        return [words(count) for _ in range(examples)]

    if trainer == "sft":
        return trl.SFTTrainer, trl.SFTConfig, {}, dict(
            train_dataset=Dataset.from_dict({"text": column(seq_len)}))
    if trainer == "dpo":
        return trl.DPOTrainer, trl.DPOConfig, {}, dict(train_dataset=Dataset.from_dict(
            {"prompt": column(prompt_len), "chosen": column(seq_len),
             "rejected": column(seq_len)}))
    if trainer == "kto":
        return trl.KTOTrainer, trl.KTOConfig, {}, dict(train_dataset=Dataset.from_dict(
            {"prompt": column(prompt_len), "completion": column(seq_len),
             "label": [i % 2 == 0 for i in range(examples)]}))
    if trainer in ("grpo", "rloo"):
        cls, config_cls, generations = ((trl.GRPOTrainer, trl.GRPOConfig, 8) if trainer == "grpo"
                                        else (trl.RLOOTrainer, trl.RLOOConfig, 2))
        # TRL's num_generations unless the batch is smaller (the smoke test's)
        return cls, config_cls, dict(max_completion_length=seq_len,
                                     num_generations=min(generations, batch)), dict(
            train_dataset=Dataset.from_dict({"prompt": column(prompt_len)}),
            reward_funcs=distinct_words_reward)
    if trainer == "gkd":
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        conversations = [[{"role": "user", "content": words(prompt_len)},
                          {"role": "assistant", "content": words(seq_len)}]
                         for _ in range(examples)]
        return GKDTrainer, GKDConfig, dict(lmbda=0.0), dict(
            train_dataset=Dataset.from_dict({"messages": conversations}),
            teacher_model=random_llama(seed=seed + 1, **model_kwargs))
    raise ValueError(f"unknown trainer {trainer!r}; one of {TRAINERS}")


@contextlib.contextmanager
def counting_head_rows(rows, calls, trainer_class):
    """Adds to ``rows["grad"]`` / ``rows["no_grad"]`` the rows of every LM-head call, and to
    ``calls["trl"]`` / ``calls["ak"]`` the call (TRL's fused head or GKD's loss on full logits;
    ours); puts the originals back on exit."""
    import torch
    from trl.trainer import utils as trl_utils

    import astrai_kernels as ak

    def count(head, *tensors, rows_of=lambda t: t.shape[:-1].numel()):  # [..., H] hidden
        calls[head] += 1
        for tensor in tensors:
            grad = torch.is_grad_enabled() and tensor.requires_grad
            rows["grad" if grad else "no_grad"] += int(rows_of(tensor))

    trl_function = trl_utils._ChunkedLogProbFunction

    class CountedChunkedLogProb:
        @staticmethod
        def apply(hidden, *args):
            count("trl", hidden)
            return trl_function.apply(hidden, *args)

    def counted(function, *tensor_positions):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            count("ak", *(args[position] for position in tensor_positions))
            return function(*args, **kwargs)
        return wrapper

    def counted_full_logits(loss):
        def wrapper(student_logits, teacher_logits, *args, **kwargs):
            count("trl", student_logits, teacher_logits)
            return loss(student_logits, teacher_logits, *args, **kwargs)
        return staticmethod(wrapper)

    replaced = [(trl_utils, "_ChunkedLogProbFunction", CountedChunkedLogProb),
                (ak, "linear_token_logprobs", counted(ak.linear_token_logprobs, 0)),
                (ak, "linear_distill_loss", counted(ak.linear_distill_loss, 0, 2))]
    if hasattr(ak, "linear_grpo_loss"):
        replaced.append((ak, "linear_grpo_loss", counted(ak.linear_grpo_loss, 0)))
    if "generalized_jsd_loss" in vars(trainer_class):  # GKD: TRL's loss on full logits
        replaced.append((trainer_class, "generalized_jsd_loss",
                         counted_full_logits(trainer_class.generalized_jsd_loss)))
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in replaced]
    try:
        for owner, name, value in replaced:
            setattr(owner, name, value)
        yield rows
    finally:
        for owner, name, value in originals:
            setattr(owner, name, value)


def _step_meter():
    """A ``TrainerCallback`` that times each optimizer step and its peak (module doc)."""
    from transformers import TrainerCallback

    class StepMeter(TrainerCallback):
        def __init__(self):
            self.peak = PeakRss()
            self.steps = []
            self.generation_seconds = 0.0
            self.rows = {"grad": 0, "no_grad": 0}
            self.calls = {"trl": 0, "ak": 0}

        def on_step_begin(self, args, state, control, **kwargs):
            self.generation_seconds = 0.0
            self.rows.update(grad=0, no_grad=0)
            self.calls.update(trl=0, ak=0)
            self.peak.start()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self.start
            self.steps.append({"seconds": seconds, "peak_bytes": self.peak.extra(),
                               "generation_seconds": self.generation_seconds,
                               "head_rows": dict(self.rows), "head_calls": dict(self.calls)})

        def timing_generation(self, generate):
            @functools.wraps(generate)
            def timed(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return generate(*args, **kwargs)
                finally:
                    self.generation_seconds += time.perf_counter() - start
            return timed

    return StepMeter()


def run_trainer_case(trainer, head, vocab=32768, model_hidden=128, layers=1, batch=8,
                     prompt_len=32, seq_len=256, repeats=2, threads=1, seed=0):
    """One trainer x head in this process; returns its result dict (``unavailable`` instead of
    the figures when ``install`` cannot serve that head)."""
    import torch
    import transformers
    import trl

    from astrai_kernels.integrations import trl as ak_trl

    if threads:
        torch.set_num_threads(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = {"trainer": trainer, "head": head, "vocab": vocab, "hidden": model_hidden,
              "layers": layers, "batch": batch, "prompt_len": prompt_len, "seq_len": seq_len,
              "threads": torch.get_num_threads(), "trl": trl.__version__,
              "transformers": transformers.__version__}
    install_options = {"fused_loss": True} if head == "ak_fused" else {}
    if install_options and "fused_loss" not in inspect.signature(ak_trl.install).parameters:
        return {**result, "unavailable": "install() takes no fused_loss keyword in this checkout"}
    model_kwargs = dict(vocab=vocab, hidden=model_hidden, layers=layers,
                        positions=prompt_len + seq_len + 8)
    steps = 1 + repeats
    cls, config_cls, config_kwargs, trainer_kwargs = _trainer_setup(
        trainer, steps * batch, batch, prompt_len, seq_len, vocab, model_kwargs, seed)
    meter = _step_meter()
    with tempfile.TemporaryDirectory(prefix="ak-bench-trl-") as tmp:
        model_dir = os.path.join(tmp, "model")
        random_llama(seed=seed, **model_kwargs).save_pretrained(model_dir)
        args = config_cls(output_dir=os.path.join(tmp, "out"), per_device_train_batch_size=batch,
                          max_steps=steps, model_init_kwargs={"dtype": torch.float32},
                          **STEP_ARGS, **config_kwargs)
        torch.manual_seed(seed)
        built = cls(model=model_dir, args=args, processing_class=word_tokenizer(vocab),
                    callbacks=[meter], **trainer_kwargs)
        if head != "trl":
            try:
                ak_trl.install(built, **install_options)
            except ak_trl.TRLHeadError as error:
                if not install_options:
                    raise
                return {**result, "unavailable": str(error)}
        generates = hasattr(built, "_generate")
        if generates:  # GRPO, RLOO: their generation, timed inside the step
            built._generate = meter.timing_generation(built._generate)
        with counting_head_rows(meter.rows, meter.calls, cls):
            torch.manual_seed(seed + 1)
            built.train()
    # the first step is the warm-up; without a resettable high-water mark only it is measured
    measured = meter.steps[1:] if meter.peak.resettable else meter.steps[:1]
    best = min(measured, key=lambda step: step["seconds"])
    return {**result, "seconds": best["seconds"],
            "generation_seconds": best["generation_seconds"] if generates else None,
            "peak_bytes": max(step["peak_bytes"] for step in measured),
            "peak_method": meter.peak.method, "head_rows": best["head_rows"],
            "head_calls": best["head_calls"],
            "step_seconds": [step["seconds"] for step in meter.steps]}


def run_trainers(trainers=TRAINERS, timeout=1800, **shape):
    """Each trainer x head of ``trainers`` in a fresh subprocess; a list of result dicts."""
    options = [item for name, value in shape.items()
               for item in (f"--{name.replace('_', '-')}", value)]
    return run_in_fresh_processes(
        [os.path.abspath(__file__)],
        [["--trainer-case", f"{trainer}:{head}", *options] for trainer in trainers
         for head in trainer_heads(trainer)], timeout)


def _trainer_rows(results):
    """Per result: its cells (strings), the ratios over the same run's TRL head."""
    mib = 1 << 20
    trl_of = {r["trainer"]: r for r in results if r["head"] == "trl" and "seconds" in r}
    rows = []
    for r in results:
        if "unavailable" in r:
            rows.append([r["trainer"], r["head"], "unavailable: " + r["unavailable"]])
            continue
        base = trl_of.get(r["trainer"])
        generation = r.get("generation_seconds")
        ratios = ["", "", ""]
        if base is not None and r is not base:
            ratios[0] = times(base["seconds"], r["seconds"])
            if generation is not None:
                ratios[1] = times(base["seconds"] - base["generation_seconds"],
                                  r["seconds"] - generation)
            ratios[2] = times(base["peak_bytes"], max(r["peak_bytes"], 1))
        rows.append([r["trainer"], r["head"], f"{r['seconds']:.2f}",
                     "" if generation is None else f"{generation:.2f}",
                     f"{r['peak_bytes'] / mib:.0f}",
                     f"{r['head_rows']['grad']} + {r['head_rows']['no_grad']}", *ratios])
    return rows


TRAINER_COLUMNS = ("trainer", "head", "step s", "generation s (in step)", "peak MiB",
                   "head rows (grad + fwd)", "TRL/this time", "TRL/this time w/o generation",
                   "TRL/this peak")


def format_trainer_table(results):
    widths = (8, 9, 7, 22, 9, 22, 13, 29, 13)
    lines = [" ".join(f"{name:>{width}}" for name, width in zip(TRAINER_COLUMNS, widths))]
    for cells in _trainer_rows(results):
        if len(cells) == 3:  # unavailable
            lines.append(f"{cells[0]:>8} {cells[1]:>9} {cells[2]}")
        else:
            lines.append(" ".join(f"{cell:>{width}}" for cell, width in zip(cells, widths)))
    return "\n".join(lines)


def trainer_markdown(results):
    """The trainer table as markdown (docs/benchmarks.md's)."""
    lines = ["| " + " | ".join(TRAINER_COLUMNS) + " |",
             "|" + "---|" * len(TRAINER_COLUMNS)]
    for cells in _trainer_rows(results):
        if len(cells) == 3:
            cells = [*cells[:2], cells[2], *[""] * (len(TRAINER_COLUMNS) - 3)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _trainer_list(text):
    if text == "none":
        return ()
    if text == "all":
        return TRAINERS
    names = tuple(name for name in text.split(",") if name)
    unknown = [name for name in names if name not in TRAINERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown trainers {unknown}; choose from {TRAINERS}")
    return names


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2048, help="head cases: N")
    parser.add_argument("--hidden", type=int, default=1024, help="head cases: H")
    parser.add_argument("--vocab", type=int, default=32768, help="head and trainer cases: V")
    parser.add_argument("--no-heads", action="store_true", help="only the trainer cases")
    parser.add_argument("--trainers", type=_trainer_list, default=TRAINERS,
                        help=f"comma-separated subset of {','.join(TRAINERS)}, 'all' (default) "
                             f"or 'none'")
    parser.add_argument("--model-hidden", type=int, default=128, help="trainer cases: hidden")
    parser.add_argument("--layers", type=int, default=1, help="trainer cases: layers")
    parser.add_argument("--batch", type=int, default=8, help="trainer cases: sequences a step")
    parser.add_argument("--prompt-len", type=int, default=32, help="trainer cases: prompt words")
    parser.add_argument("--seq-len", type=int, default=256,
                        help="trainer cases: scored tokens per sequence")
    parser.add_argument("--markdown", action="store_true",
                        help="print the trainer table as markdown too")
    add_step_arguments(parser, repeats=2)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--trainer-case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shape = dict(rows=args.rows, hidden=args.hidden, vocab=args.vocab, repeats=args.repeats,
                 threads=args.threads)
    trainer_shape = dict(vocab=args.vocab, model_hidden=args.model_hidden, layers=args.layers,
                         batch=args.batch, prompt_len=args.prompt_len, seq_len=args.seq_len,
                         repeats=args.repeats, threads=args.threads)
    if args.case is not None:
        print(json.dumps(run_case(args.case, **shape)))
        return
    if args.trainer_case is not None:
        trainer, head = args.trainer_case.split(":")
        print(json.dumps(run_trainer_case(trainer, head, **trainer_shape)))
        return
    results = []
    if not args.no_heads:
        heads = run_all(**shape)
        print(f"TRL {heads[0]['trl']} heads vs astrai-kernels, N={args.rows}, H={args.hidden}, "
              f"V={args.vocab}, float32, forward + backward, {args.threads or 'default'} "
              f"thread(s), best of {args.repeats}; peak = RSS high-water above the run's start; "
              f"x floor: time over the matmuls' (4 for the divergence)")
        print(format_table(heads))
        results += heads
    if args.trainers:
        steps = run_trainers(args.trainers, **trainer_shape)
        print(f"\nOne optimizer step of TRL {steps[0]['trl']}'s trainers, TRL's head vs install "
              f"(ak), random Llama hidden={args.model_hidden}, {args.layers} layer(s), "
              f"V={args.vocab}, batch {args.batch}, prompt {args.prompt_len} + {args.seq_len} "
              f"scored tokens, float32, {args.threads or 'default'} thread(s), best of "
              f"{args.repeats} after a warm-up; peak = RSS high-water above the step's start; "
              f"GRPO/RLOO steps include their generation")
        print(format_trainer_table(steps))
        if args.markdown:
            print("\n" + trainer_markdown(steps))
        results += steps
    write_results(args.json, results)


if __name__ == "__main__":
    main()
