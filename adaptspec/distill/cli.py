"""`adaptspec distill`: build a draft for a target, end to end.

corpus (offline) -> on-policy data (the target's own continuations, batched) ->
knowledge distillation under a time budget, with held-out agreement tracked ->
export (a head folder or an HF model folder) + ``curve.json`` / ``curve.png`` /
``summary.json``.
"""
from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console


def register(app: typer.Typer) -> None:
    @app.command("distill")
    def distill_cmd(
        target: str = typer.Option("smollm2-135m", help="target model: alias, folder or .gguf"),
        source: str = typer.Option("corpus", help="corpus (the offline prompt corpus, on-the-fly teacher; head or "
                                                  "model) or sharegpt (an EAGLE-3 head from ShareGPT + on-policy "
                                                  "answers, stored features; resumable phases)"),
        feature_layers: Optional[str] = typer.Option(None, "--feature-layers", help="sharegpt: the target's hidden "
                                                     "states to fuse, e.g. 2,15,27 (default: EAGLE-3's low/mid/high)"),
        onpolicy_tokens: int = typer.Option(120_000, "--onpolicy-tokens", help="sharegpt: target answer tokens"),
        offpolicy_tokens: int = typer.Option(120_000, "--offpolicy-tokens",
                                             help="sharegpt: ShareGPT assistant tokens, teacher-forced"),
        phases: str = typer.Option("generate,features,train,export", help="sharegpt: phases to run"),
        kind: str = typer.Option("head", help="head (feature-level, EAGLE-style) or model (independent)"),
        out: Optional[Path] = typer.Option(None, help="output folder (the draft, checkpoints, curve, summary); "
                                                     "sharegpt: default $ADAPTSPEC_HOME/distill/sharegpt-TARGET"),
        layers: int = typer.Option(1, help="decoder layers of the draft"),
        hidden: Optional[int] = typer.Option(None, help="model kind: hidden size (default: the target's)"),
        vocab_top: Optional[int] = typer.Option(None, "--vocab-top", help="head kind: keep the N most frequent tokens"),
        tokens: int = typer.Option(200_000, help="on-policy continuation tokens to generate (training data)"),
        held_out_tokens: int = typer.Option(20_000, "--held-out-tokens", help="greedy continuation tokens of held-out prompts"),
        time_budget: Optional[float] = typer.Option(None, "--time-budget", help="training minutes (cosine LR over it)"),
        gen_time_budget: Optional[float] = typer.Option(None, "--gen-time-budget", help="data generation minutes at most"),
        steps: Optional[int] = typer.Option(None, help="training steps at most"),
        epochs: float = typer.Option(100.0, help="passes over the data at most"),
        resume: bool = typer.Option(False, help="continue from OUT/ckpt.pt and the saved data"),
        loss: str = typer.Option("mix", help="kl, tv or mix (kl + tv)"),
        passes: int = typer.Option(3, help="head kind: drafting steps unrolled in training"),
        lr: float = typer.Option(1e-3, help="peak learning rate"),
        batch_tokens: int = typer.Option(4096, "--batch-tokens", help="padded tokens per training batch"),
        gen_batch: int = typer.Option(32, "--gen-batch", help="sequences decoded at once for the data"),
        max_new_tokens: int = typer.Option(192, "--max-new-tokens", help="continuation length per prompt"),
        samples: int = typer.Option(1, help="sampled continuations per prompt, besides the greedy one"),
        data: Optional[Path] = typer.Option(None, help="data file to use/extend (default OUT/data.pt)"),
        max_train_tokens: Optional[int] = typer.Option(None, "--max-train-tokens", help="train on the first N data tokens only"),
        init: str = typer.Option("target", help="target (warm start from the target's layers), random, or "
                                                "(sharegpt) a saved head to continue, e.g. smollm2-135m-draft"),
        device: str = typer.Option("cpu", help="cpu or cuda"),
        dtype: str = typer.Option("float32", help="the target's dtype for data and features"),
        seed: int = typer.Option(0),
        eval_every: float = typer.Option(60.0, "--eval-every", help="seconds between held-out evaluations"),
    ):
        """Distill a draft (head or model) for TARGET on its own continuations."""
        if source == "sharegpt":
            from adaptspec.distill.pipeline import Plan, run
            from adaptspec.models.registry import home

            out = out or home() / "distill" / f"sharegpt-{Path(target).name}"

            flayers = [int(x) for x in feature_layers.split(",")] if feature_layers else None
            train = {"layers": layers, "vocab_top": vocab_top or 8192, "passes": passes, "lr": lr,
                     "batch_tokens": batch_tokens, "epochs": epochs if epochs != 100.0 else 4.0, "steps": steps,
                     "time_budget_s": time_budget * 60 if time_budget is not None else None, "seed": seed,
                     "init": init}
            if init not in ("target", "random"):  # continue a saved head: its architecture and vocabulary
                from adaptspec.distill.head import read_head_config
                from adaptspec.models.registry import resolve

                hc = read_head_config(resolve(init, quiet=True))
                train.update(init="target", init_head=init, arch=hc.arch, layers=hc.num_layers,
                             vocab_top=hc.draft_vocab_size)
            plan = Plan(run=out, target=target, dtype=dtype if dtype != "float32" else "bfloat16",
                        onpolicy_tokens=onpolicy_tokens, offpolicy_tokens=offpolicy_tokens,
                        max_new_tokens=min(max_new_tokens, 128), gen_batch=gen_batch, feature_layers=flayers,
                        seed=seed, device=device, train=train)
            run(plan, [p for p in phases.split(",") if p])
            return
        if source != "corpus":
            raise ValueError(f"source: must be corpus or sharegpt, got {source!r}")
        if out is None:
            raise ValueError("out: an output folder is required with --source corpus")
        from adaptspec.distill.train import TrainConfig

        cfg = TrainConfig(kind=kind, layers=layers, hidden=hidden, vocab_top=vocab_top, loss=loss, passes=passes,
                          lr=lr, batch_tokens=batch_tokens, steps=steps, epochs=epochs,
                          time_budget_s=time_budget * 60 if time_budget is not None else None,
                          max_train_tokens=max_train_tokens, seed=seed, init=init, eval_every_s=eval_every)
        run_distill(target, cfg, out, tokens=tokens, held_out_tokens=held_out_tokens,
                    gen_time_budget_s=gen_time_budget * 60 if gen_time_budget else None, resume=resume,
                    gen_batch=gen_batch, max_new_tokens=max_new_tokens, samples=samples, data_path=data,
                    device=device, dtype=dtype, seed=seed)


def run_distill(target: str, cfg, out: Path, *, tokens: int, held_out_tokens: int, gen_time_budget_s=None,
                resume: bool = False, gen_batch: int = 32, max_new_tokens: int = 192, samples: int = 1,
                data_path: Path | None = None, device: str = "cpu", dtype: str = "float32", seed: int = 0,
                console: Console | None = None) -> dict:
    import torch
    from transformers import AutoConfig

    from adaptspec.distill.corpus import build_corpus
    from adaptspec.distill.data import Dataset, generate
    from adaptspec.distill.train import Trainer
    from adaptspec.engine.engine import Engine, EngineConfig
    from adaptspec.engine.params import MAX_K
    from adaptspec.models.loader import load_model, load_weights

    con = console or Console()
    out = Path(out)
    if out.exists() and any(out.glob("*.safetensors")) and not resume and (out / "ckpt.pt").exists():
        raise ValueError(f"out: {out} already holds a distillation; pass --resume to continue it or pick a new folder")
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    corpus = build_corpus(seed)
    con.print("corpus (train / held-out prompts): " + ", ".join(f"{c} {a}/{b}" for c, (a, b) in corpus.sizes().items()))
    t = load_model(target, dtype=dtype, device=device, quiet=True)
    weights = load_weights(t.path)
    hf_cfg = AutoConfig.from_pretrained(t.path)
    max_prompt = 384
    eng = Engine(t, None, EngineConfig(max_num_seqs=gen_batch, max_model_len=max_prompt + max_new_tokens + MAX_K + 2))
    data_path = Path(data_path) if data_path else out / "data.pt"
    held_path = out / "held_out.pt" if data_path.parent == out else data_path.with_name(data_path.stem + ".held_out.pt")
    held = generate(eng, corpus.held_out, held_path, tokens=held_out_tokens, samples=0,
                    max_new_tokens=max_new_tokens, seed=seed + 1, console=con, label="held-out data")
    data = generate(eng, corpus.train, data_path, tokens=tokens, time_budget_s=gen_time_budget_s, samples=samples,
                    max_new_tokens=max_new_tokens, seed=seed, console=con, label="on-policy data")
    gen_rate = data.output_tokens / max(data.gen_seconds, 1e-9)
    con.print(f"data: {data.output_tokens:,} continuation tokens in {len(data.examples):,} sequences "
              f"({data.gen_seconds:.0f} s of decoding, {gen_rate:,.0f} tok/s); held-out {held.output_tokens:,}")
    del eng
    trainer = Trainer(weights, t.model, hf_cfg, cfg, data, held, out, device, con, target_name=target)
    con.print(f"training a {cfg.kind} draft: {trainer.num_params / 1e6:.2f}M trainable parameters, loss {cfg.loss}"
              + (f", draft vocabulary {cfg.vocab_top} covering {trainer.coverage:.1%} of the data's tokens"
                 if cfg.kind == "head" and cfg.vocab_top else ""))
    t_train = time.perf_counter()
    state = trainer.train(resume=resume)
    train_s = time.perf_counter() - t_train
    trainer.use_best()
    final = trainer.evaluate()
    _export(trainer, t, out, target, cfg)
    summary = {
        "target": target, "kind": cfg.kind, "config": asdict(cfg), "device": _device_name(device), "dtype": dtype,
        "data": {"tokens": data.output_tokens, "sequences": len(data.examples), "gen_seconds": round(data.gen_seconds, 1),
                 "held_out_tokens": held.output_tokens,
                 "prompts": {c: len(v) for c, v in corpus.train.items()},
                 "held_out_prompts": {c: len(v) for c, v in corpus.held_out.items()}},
        "trainable_parameters": trainer.num_params, "vocab_coverage": round(trainer.coverage, 4),
        "train_seconds": round(state.elapsed_s, 1), "wall_seconds": round(time.perf_counter() - t_all, 1),
        "steps": state.step, "tokens_seen": state.tokens_seen, "held_out": final,
        "date": time.strftime("%Y-%m-%d"),
    }
    (out / "curve.json").write_text(json.dumps(state.curve, indent=1) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    try:
        plot_curve(state.curve, out / "curve.png", f"{cfg.kind} draft for {target}")
    except Exception as exc:  # a plot is a convenience, never a failure
        con.print(f"[yellow]no plot: {exc}")
    con.print(f"[bold green]draft written to {out}[/]: held-out alpha {final['alpha']:.3f} "
              + ", ".join(f"{c} {v['alpha1']:.3f}" for c, v in final["per_class"].items())
              + f" ({state.step} steps, {train_s:.0f} s)")
    return summary


def _export(trainer, target, out: Path, target_name: str, cfg) -> None:
    import torch

    if cfg.kind == "head":
        from adaptspec.distill.head import save_head

        head = trainer.student
        head.cfg.training = {"loss": cfg.loss, "passes": cfg.passes, "steps": trainer.state.step,
                             "tokens_seen": trainer.state.tokens_seen, "data_tokens": trainer.data.output_tokens}
        save_head(head, out, dtype=torch.bfloat16)
    else:
        model = trainer.student
        model.config.quantization_config = None
        model.to(torch.bfloat16).save_pretrained(out)
        model.float()
        target.tokenizer.save_pretrained(out)


def _device_name(device: str) -> str:
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def plot_curve(curve: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    x = [p["tokens_seen"] for p in curve]
    for key, style in (("alpha1", "-"), ("alpha2", "--"), ("alpha3", ":")):
        y = [p["held_out"].get(key) for p in curve]
        if any(v is not None for v in y):
            ax[0].plot(x, y, style, label=f"{key} (drafted position {key[-1]})")
    ax[0].set_xlabel("training positions seen")
    ax[0].set_ylabel("held-out greedy agreement")
    ax[0].legend()
    ax[0].grid(alpha=0.3)
    classes = sorted({c for p in curve for c in p["held_out"].get("per_class", {})})
    for c in classes:
        ax[1].plot(x, [p["held_out"]["per_class"].get(c, {}).get("alpha1") for p in curve], label=c)
    ax[1].set_xlabel("training positions seen")
    ax[1].set_ylabel("held-out alpha (position 1)")
    ax[1].legend()
    ax[1].grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_acceptance_curve(curve: list[dict], path: Path, title: str) -> None:
    """Held-out acceptance (simulated drafting, per class) against training tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [p for p in curve if p.get("held_out")]
    if not pts:
        return
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    x = [p["tokens_seen"] for p in pts]
    ax[0].plot(x, [p["held_out"]["a"] for p in pts], label="a (per-token acceptance, k = 4)")
    ax[0].plot(x, [p["held_out"]["alpha"] for p in pts], "--", label="alpha (first candidate)")
    ax[0].set_xlabel("training positions seen")
    ax[0].set_ylabel("held-out acceptance")
    ax[0].legend()
    ax[0].grid(alpha=0.3)
    for c in sorted({c for p in pts for c in p["held_out"].get("per_class", {})}):
        ax[1].plot(x, [p["held_out"]["per_class"].get(c, {}).get("acc_len") for p in pts], label=c)
    ax[1].set_xlabel("training positions seen")
    ax[1].set_ylabel("held-out accepted length (k = 4)")
    ax[1].legend()
    ax[1].grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
