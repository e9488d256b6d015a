"""The report writer: `<out>.json` (every figure of the run) and `<out>.md` (command, machine,
versions, load, the ratio table with each side's spread and each ratio's per-repeat range,
per-pair details, and the hand-written findings of findings.md)."""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.peerbench.config import LORA, ROOT, TOL

FINDINGS = Path(__file__).with_name("findings.md")  # hand-written, kept with the code that cites it


def versions(skyrl_python: str | None) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "torchtitan", "transformers", "trl", "peft", "accelerate", "datasets",
                "tinker"):  # fmt: skip
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    if skyrl_python and Path(skyrl_python).exists():
        code = (
            "from importlib.metadata import version as v;"
            "print(' '.join(f'{p}={v(p)}' for p in ('skyrl-tx','jax','transformers','tinker')))"
        )
        p = subprocess.run([skyrl_python, "-c", code], capture_output=True, text=True)
        out["skyrl_venv"] = p.stdout.strip() or p.stderr.strip()[-200:]
    git = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    out["titanscale_commit"] = git.stdout.strip()
    return out


def fmt_s(s: dict, digits: int = 3) -> str:
    if s["median"] is None:
        return "n/a"
    if s["n"] == 1:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def _loss0(r: dict, required: bool = True) -> str:
    l0 = r.get("loss_step0")
    if not l0:
        return ""
    mark = "" if l0["abs_diff"] < TOL or not required else " **(> 1e-4)**"
    return f"{l0['ours']:.6f} / {l0['peer']:.6f} ({l0['abs_diff']:.1e}){mark}"


def fmt_rate(amount: float, s: dict) -> str:
    """`amount` per unit of a summarized time: median [min-max] (the fastest run is the max)."""
    if s["median"] is None:
        return "n/a"
    if s["n"] == 1:
        return f"{amount / s['median']:,.0f}"
    return f"{amount / s['median']:,.0f} [{amount / s['max']:,.0f}-{amount / s['min']:,.0f}]"


def fmt_ratio(value: float, rng: dict | None, bold: bool = False) -> str:
    """A ratio of medians and the min-max of the per-repeat ratios (measure.ratio_range)."""
    v = f"**{value:.2f}**" if bold else f"{value:.2f}"
    if not rng or rng["n"] < 2:
        return v
    return f"{v} [{rng['min']:.2f}-{rng['max']:.2f}]"


Row = tuple[str, str, str, str, str, float, float, str, dict | None, dict | None]


def ratio_rows(P: dict[str, Any]) -> list[Row]:
    """(pair, ours, peer, ours' figure, peer's figure, wall ratio, CPU ratio, step-0 loss,
    wall ratio's per-repeat range, CPU ratio's per-repeat range). Each side's figure carries
    its median [min-max] over repeats, wall and CPU."""
    rows: list[Row] = []
    for key, ours, peer in (
        ("sft_lora_packed", "LoRA SFT, packing bfd", "TRL SFTTrainer + PEFT, packing bfd"),
        ("sft_lora_unpacked", "LoRA SFT, packing none", "TRL SFTTrainer + PEFT, no packing"),
        ("full_ft", "full fine-tune, packing none", "transformers Trainer"),
    ):
        r = P.get(key)
        if r and "error" not in r:
            n = r["config"]["tokens_per_step"]
            figs = [f"{fmt_rate(n, r[f'{w}_step_s'])} tok/s, "
                    f"{fmt_rate(n, r[f'{w}_cpu_s_per_step'])} tok/CPU-s" for w in ("ours", "peer")]  # fmt: skip
            rows.append((key, ours, peer, figs[0], figs[1], r["ratio"], r["cpu_ratio"], _loss0(r),
                         r.get("ratio_range"), r.get("cpu_ratio_range")))  # fmt: skip
    g = P.get("generate")
    if g and "error" not in g:
        for mode in ("greedy", "sampled"):
            r = g[mode]
            n = r["tokens"]
            figs = [f"{fmt_rate(n, r[f'{w}_s'])} tok/s, {fmt_rate(n, r[f'{w}_cpu_s'])} tok/CPU-s"
                    for w in ("ours", "peer")]  # fmt: skip
            rows.append((f"generate, {mode}", "rl.generator.Generator",
                         "transformers generate (KV cache)", figs[0], figs[1], r["ratio"],
                         r["cpu_ratio"], "", r.get("ratio_range"), r.get("cpu_ratio_range")))  # fmt: skip
    for key, ours, peer, unit in (
        ("grpo", "train.py, recipes/rl_debug.toml", "TRL GRPOTrainer", "update"),
        ("dpo", "tools.serve, forward_backward_custom", "TRL DPOTrainer + PEFT", "step"),
    ):
        r = P.get(key)
        if r and "error" not in r:
            figs = [f"{fmt_s(r[f'{w}_step_s'])} s/{unit}, {fmt_s(r[f'{w}_cpu_s_per_step'])} "
                    f"CPU-s/{unit}" for w in ("ours", "peer")]  # fmt: skip
            rows.append((key, ours, peer, figs[0], figs[1], r["ratio"], r["cpu_ratio"],
                         _loss0(r) if key == "dpo" else "", r.get("ratio_range"),
                         r.get("cpu_ratio_range")))  # fmt: skip
    s = P.get("service", {})
    for key, what in (
        ("train_step_s", "forward_backward + optim_step"),
        ("sample_s", "sample, 8 x 16 tokens"),
    ):
        if key in s:
            r = s[key]
            figs = [f"{fmt_s(r[w])} s, {fmt_s(r[f'{w}_cpu'])} CPU-s" for w in ("ours", "peer")]
            rows.append((f"service: {what}", "tools.serve", "skyrl-tx Tinker server",
                         figs[0], figs[1], r["ratio"], r["cpu_ratio"],
                         _loss0(s, False) if key == "train_step_s" else "",
                         r.get("ratio_range"), r.get("cpu_ratio_range")))  # fmt: skip
    return rows


def details(P: dict[str, Any]) -> list[str]:
    """Per pair: what was run, the loss agreement, quality figures, start-up costs."""
    L = ["", "## Per pair", ""]
    for key in ("sft_lora_packed", "sft_lora_unpacked", "full_ft"):
        r = P.get(key)
        if not r or "error" in r:
            continue
        c = r["config"]
        ln = r["loss_stepN"]
        L.append(
            f"- **{key}**: {c['steps']} steps ({c['warmup_steps_excluded']} warm-up steps not "
            f"timed), {c['rows_per_step']} rows x {c['examples_per_row']} examples = "
            f"{c['tokens_per_step']} tokens per step ({c['trained_tokens_per_step']} trained), "
            f"lr {c['lr']}, no warmup then linear decay, AdamW betas (0.9, 0.95), clip 1.0, "
            f"float32; titanscale rows of {c['seq_len_titanscale_pairs']} next-token pairs"
            + (
                " (each batch cut after its last trained pair, rounded up to 8: "
                "data.loader.trim_padding)"
                if "unpacked" in key or key == "full_ft"
                else ""
            )
            + f", the peer's max_length {c['max_length_peer_tokens']} tokens. Step-0 loss "
            f"{_loss0(r)}; the same in every repeat on each side (spread "
            f"{r['loss_step0_spread_over_repeats']:.1e}). Loss after step {ln['step']}: "
            f"{ln['ours']:.4f} ours, {ln['peer']:.4f} peer. Process wall (start-up, training, "
            f"exit): {fmt_s(r['process_wall_s']['ours'], 1)} s ours, "
            f"{fmt_s(r['process_wall_s']['peer'], 1)} s peer."
        )
    g = P.get("generate")
    if g and "error" not in g:
        gi, c = g["greedy_identical"], g["config"]
        L.append(
            f"- **generate**: {c['prompts']} prompts (lengths {g['prompt_lengths']} tokens: half "
            f"arithmetic, half letter-sorting chat prompts, left-padded), {c['max_new']} new "
            f"tokens per row with no stop token, float32, KV cache on both sides; sampled: "
            f"{c['group']} samples per prompt at temperature 1 (transformers: top_k 0). Greedy "
            f"outputs identical in {gi['identical']} of {gi['rows']} rows (first differing "
            f"position per row: {gi['first_difference_at']})."
        )
    r = P.get("grpo")
    if r and "error" not in r:
        c, h = r["config"], r["heldout_reward"]
        L.append(
            f"- **grpo**: arithmetic (rl/envs.py), {c['steps']} updates of {c['prompts']} prompts "
            f"x {c['group']} samples, max 4 new tokens, lr {c['lr']}, clip 0.2 / 0.28, no KL, "
            "token-mean loss (TRL loss_type 'dapo'), group-normalized advantages, one optimizer "
            "step per batch, full weights. Held-out reward (greedy, all 55 held-out prompts): "
            f"ours {fmt_s(h['ours_before'])} -> {fmt_s(h['ours_after'])}, TRL "
            f"{fmt_s(h['peer_before'])} -> {fmt_s(h['peer_after'])} (ours: titanscale's rl_eval; "
            "TRL: transformers generate on its trained model; the two evaluators agree on the "
            "base, the 'before' column). Mean training reward "
            f"{fmt_s(r['train_reward_mean']['ours'])} ours, {fmt_s(r['train_reward_mean']['peer'])} "
            "TRL. The first update is not timed, nor titanscale's last (it runs the held-out "
            "evaluation inside its timed step)."
        )
    r = P.get("dpo")
    if r and "error" not in r:
        lp = r["logps_step0"]
        ln = r["loss_stepN"]
        L.append(
            f"- **dpo**: letter-sorting pairs (chosen = sorted, rejected = reversed), "
            f"{r['config']['pairs_per_step']} pairs per step, beta {r['config']['beta']}, "
            f"LoRA rank {LORA['rank']} alpha {LORA['alpha']:g}, lr {r['config']['lr']} linear "
            "decay. titanscale: tinker SDK against tools.serve, reference log-probs from "
            "`forward` before training, the DPO loss in forward_backward_custom (the SDK "
            "computes it client-side and sends per-token gradients). Step 0: loss "
            f"{_loss0(r)} (policy = reference: ln 2 on both sides); sequence log-probs "
            f"chosen {lp['logps_chosen']['ours']:.5f} / {lp['logps_chosen']['peer']:.5f} "
            f"(diff {lp['logps_chosen']['abs_diff']:.1e}), rejected "
            f"{lp['logps_rejected']['ours']:.5f} / {lp['logps_rejected']['peer']:.5f} (diff "
            f"{lp['logps_rejected']['abs_diff']:.1e}). Loss after step {ln['step']}: "
            f"{ln['ours']:.4f} ours, {ln['peer']:.4f} TRL. CPU: the service's process plus the "
            "client's against TRL's one process."
        )
    s = P.get("service")
    if s and "train_step_s" in s:
        f = s["first_call_s"]
        L.append(
            f"- **service**: the same script (benchmarks/peerbench/tinker_workers.py `w_tinker_script`: LoRA rank {LORA['rank']}, "
            f"{s['config']['steps']} x (forward_backward of {s['config']['batch']} examples + "
            f"optim_step), save_weights_and_get_sampling_client, {s['config']['samples']} x "
            f"sample(8 x {s['config']['max_tokens']} tokens)); SDK {s['sdk']['ours']} against "
            f"tools.serve, {s['sdk']['peer']} against skyrl-tx (0.3.0 predates the SDK's "
            "/api/v1/client/config; tools.serve needs the newer SDK's protobuf requests). "
            f"Step-0 loss {_loss0(s, False)}. First forward_backward + optim_step (not in the ratios): "
            f"{fmt_s(f['ours'], 1)} s ours, {fmt_s(f['peer'], 1)} s skyrl-tx (JAX compiles). "
            f"Server start to healthy: {s['tools_serve_start_s']:.0f} s tools.serve, "
            f"{s.get('skyrl_start_s', float('nan')):.0f} s skyrl-tx (its engine process loads "
            "the model after that)."
        )
    return L


def before_of(earlier: dict[str, Any]) -> dict[str, Any]:
    """An earlier run's ratios per table row, with its date, commit and load: the 'before'
    columns of a rerun (`--before`), kept in the new .json so the report stands alone."""
    m = earlier["meta"]
    return {
        "date": m["date"],
        "commit": m["versions"].get("titanscale_commit", "?"),
        "command": m["command"],
        "load_median": m["load_median"],
        "ratios": {row[0]: [row[5], row[6]] for row in ratio_rows(earlier["pairs"])},
    }


def write_report(results: dict[str, Any], out: Path) -> None:
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    m = results["meta"]
    P = results["pairs"]
    L: list[str] = [
        "# titanscale side by side with its peers (CPU)",
        "",
        (
            f"Merged (`--merge`) from {len(m['merged_from'])} runs that overlapped in time: "
            f"{m['command']}"
            if m.get("merged_from")
            else f"`{m['command']}`"
        )
        + f", {m['date']}, {m['wall_minutes']:.1f} minutes. {m['machine']}; "
        f"{m['threads']} thread(s) per process, one process at a time, {m['repeats']} "
        "repeat(s) per side, the sides interleaved (ours, peer, peer, ours, ...)."
        + (
            " --one-worker-process: the peers' and the tinker clients' runs shared one "
            "process (a loss check: these timings are not the benchmark's)."
            if m.get("one_worker_process")
            else ""
        ),
        "",
        f"Load average (1 min) at the start of each run: {m['load_min']:.1f} to "
        f"{m['load_max']:.1f}, median {m['load_median']:.1f}, on 2 cores: other jobs shared "
        "the machine. Wall times therefore depend on the moment; CPU time (user + system of "
        "the processes doing the work: train.py, the peer's process, the server's process tree "
        "plus its client) counts the work itself and is the figure to compare. Both are given.",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ".",
        "",
        f"skyrl-tx install (its own venv, it pins transformers < 5): `{m['skyrl_install']}`.",
        "",
        "## Ratios: ours / peer (> 1 = titanscale faster)",
        "",
        "Each side: median over its repeats [min-max over the repeats]; per run, the median "
        "step after the warm-up steps (wall) or the mean CPU seconds per step over the same "
        "steps. Each ratio: the peer's median over ours [min-max of the per-repeat ratios: "
        "repeat r's peer run over repeat r's run of ours, the two adjacent in time under the "
        "interleaving]; the range is of the repeats measured, not a confidence interval.",
        "",
    ]
    befores = results.get("before", [])
    for b in befores:
        L.append(
            f"- 'at {b['commit']}': CPU ratio (wall ratio) of `{b['command']}` at titanscale "
            f"commit {b['commit']}, {b['date']}, median load {b['load_median']:.1f} (`--before`)."
        )
    L += [
        "" if befores else None,
        "| pair | titanscale | peer | ours | peer | wall ratio | CPU ratio | "
        + "".join(f"at {b['commit']} | " for b in befores)
        + "step-0 loss ours / peer (abs diff) |",
        "|---|---|---|---|---|---|---|" + "---|" * len(befores) + "---|",
    ]
    L = [x for x in L if x is not None]
    if m.get("pairs_pending"):
        L.insert(
            2,
            f"**Partial: written after each pair; not run (yet): {', '.join(m['pairs_pending'])}.**\n",
        )
    for name, ours, peer, a, b, wr, cr, loss, wrr, crr in ratio_rows(P):
        was = "".join(
            f"{r[1]:.2f} ({r[0]:.2f}) | " if r else "| "
            for r in (bf["ratios"].get(name) for bf in befores)
        )
        L.append(
            f"| {name} | {ours} | {peer} | {a} | {b} | {fmt_ratio(wr, wrr)} | "
            f"{fmt_ratio(cr, crr, bold=True)} | {was}{loss} |"
        )
    L.append("")
    for name, r in P.items():
        if isinstance(r, dict) and "error" in r:
            L.append(f"- **{name} did not run**: {r['error'][-600:]}")
    s = P.get("service", {})
    if isinstance(s.get("skyrl"), str):
        L.append(f"- **service / skyrl-tx**: {s['skyrl']}")
    L += details(P)
    L += ["", FINDINGS.read_text().strip()]
    out.with_suffix(".md").write_text("\n".join(L) + "\n")
