"""What the GRPO benchmarks share: the machine report, the storage meter around a step, the small
Llama they train, TRL's GRPOTrainer set up like our side, and the reward plots' axes, trailing
mean and file writing (`grpo_memory.py`, `grpo_speed.py`, `grpo_reward_time.py`).

    from _grpo_sides import cpu_report, measure, small_llama_dir, trl_grpo_trainer
    trainer = trl_grpo_trainer(model_dir, rows, out, prompts=4, group=8, completion=12, max_steps=5,
                               reward_funcs=[length_reward])
    trainer.train()
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from _machine import cpu_report  # noqa: F401  (the GRPO benchmarks import it from here)


def length_reward(prompts, completions, **columns):
    """Any reward that varies within a group: a step's memory and time do not depend on its values."""
    return [float(len(c) % 7) for c in completions]


def measure(run, *adopt) -> dict:
    """Peak live tensor bytes and wall time of `run()`, the `adopt`-ed objects counted as live:
    step_bytes = what `run` adds, total_bytes = the peak with them."""
    from maximus.memory.meter import MemoryMeter

    meter = MemoryMeter("cpu")
    with meter.track(*adopt):
        before = meter.current_bytes()
        meter.reset_peak()
        t = time.perf_counter()
        extra = run() or {}
        seconds = time.perf_counter() - t
    return {"step_bytes": meter.peak_bytes() - before, "total_bytes": meter.peak_bytes(), "step_seconds": seconds, **extra}


def small_llama_dir(root: Path) -> Path:
    """A random 4-layer Llama (vocab 32,000, hidden 256) with the tiny tokenizer, saved under `root`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from maximus.data.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    config = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model_dir = root / "model"
    LlamaForCausalLM(config).save_pretrained(str(model_dir), safe_serialization=True)
    tok.save_pretrained(str(model_dir))
    return model_dir


def trl_grpo_trainer(model_dir, rows: list[dict], out: Path, *, prompts: int, group: int, completion: int,
                     max_steps: int, reward_funcs: list, callbacks=(), gradient_checkpointing: bool = True,
                     adapter: str | Path | None = None, lora_r: int = 16, lora_alpha: int = 32, lr_lambda=None,
                     **config):
    """TRL's GRPOTrainer (no vLLM, fp32 on the CPU) as our side runs: `prompts` x `group`
    completions per optimizer step in one batch (`per_device_train_batch_size`), up to
    `completion` new tokens, beta 0, loss_type dapo, one update per generation; a fresh LoRA
    (r=`lora_r` on all linear layers) or the trainable PEFT `adapter` saved at that path. `rows`:
    dataset rows with a `prompt` column (other columns reach the rewards); `config`: more
    GRPOConfig fields (learning_rate, temperature, lr_scheduler_type, seed, ...). `lr_lambda`:
    step -> factor of learning_rate, in place of GRPOConfig's scheduler (Transformers' linear
    warm-up starts at 0, step / warmup; ours at 1 / (warmup + 1)), with torch AdamW as
    Transformers builds it (betas 0.9/0.999, eps 1e-8, weight decay 0)."""
    from datasets import Dataset
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_config = None
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    else:
        peft_config = LoraConfig(r=lora_r, lora_alpha=lora_alpha, target_modules="all-linear", task_type="CAUSAL_LM")
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=prompts * group, num_generations=group,
                      max_completion_length=completion, beta=0.0, loss_type="dapo", max_steps=max_steps,
                      gradient_checkpointing=gradient_checkpointing, use_cpu=True, report_to=[], bf16=False,
                      save_strategy="no", logging_steps=1, **{"seed": 0, **config})
    optimizers = (None, None)
    if lr_lambda is not None:
        if peft_config is not None:
            raise ValueError("lr_lambda needs the adapter loaded here (adapter=...): the optimizer is built before the trainer")
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate,
                                      betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                                      weight_decay=args.weight_decay)
        optimizers = (optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda))
    return GRPOTrainer(model=model, reward_funcs=reward_funcs, args=args, train_dataset=Dataset.from_list(rows),
                       processing_class=tok, callbacks=list(callbacks), peft_config=peft_config, optimizers=optimizers)


#: A step's mean reward covers a few prompts only: noisy, so the plots draw a trailing mean beside it.
WINDOW = 10


def trailing_mean(values: list[float], window: int = WINDOW) -> list[float]:
    """values[i] averaged with the `window` - 1 before it (fewer at the start)."""
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def reward_axes(figsize: tuple[float, float]):
    """(figure, axes) of a reward plot, drawn without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=figsize)


def save_plot(fig, ax, out: Path) -> None:
    """Grid, tight layout, and `out` written whole (a temporary file, then renamed)."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)
    print(f"wrote {out}")
