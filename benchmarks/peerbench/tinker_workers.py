"""Tinker SDK clients (one per process): DPO through forward_backward_custom against
tools.serve, and the service script (forward_backward + optim_step, then sample) that runs
unchanged against tools.serve and skyrl-tx's server (in the skyrl-tx venv: no titanscale
imports, torch only where the DPO client needs it)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.peerbench.config import ADAM, API_KEY, LORA
from benchmarks.peerbench.measure import StepClock


def _tinker_client(url: str):
    import tinker

    sc = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    base = sc.get_server_capabilities().supported_models[0].model_name
    return sc, base


def w_tinker_dpo(a: dict) -> dict:
    """DPO through the Tinker API: reference log-probs from `forward` before training (the
    policy is then the base: LoRA B = 0), then forward_backward_custom with the DPO loss and
    optim_step per batch."""
    import torch
    import torch.nn.functional as F
    from tinker import types

    torch.set_num_threads(a["threads"])
    data = json.loads(Path(a["data"]).read_text())
    sc, base = _tinker_client(a["url"])
    tc = sc.create_lora_training_client(base_model=base, rank=LORA["rank"], seed=0)

    def datum(prompt: list[int], completion: list[int]):
        toks = prompt + completion
        w = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
        return types.Datum(
            model_input=types.ModelInput.from_ints(toks[:-1]),
            loss_fn_inputs={"target_tokens": toks[1:], "weights": w},
        )

    B = a["batch"]
    batches = []
    for s in range(a["steps"]):
        rows = data[s * B : (s + 1) * B]
        ds = []
        for d in rows:  # [chosen, rejected] per pair
            ds += [
                datum(d["prompt_ids"], d["chosen_ids"]),
                datum(d["prompt_ids"], d["rejected_ids"]),
            ]
        batches.append(ds)

    def seq_logps(ds, logprobs) -> list[torch.Tensor]:
        return [
            (lp * torch.tensor(d.loss_fn_inputs["weights"].tolist())).sum()
            for d, lp in zip(ds, logprobs, strict=True)
        ]

    refs = []
    for ds in batches:  # the policy is the base until the first optim_step
        out = tc.forward(ds, "cross_entropy").result()
        refs.append(
            [
                float(x)
                for x in seq_logps(ds, [o["logprobs"].to_torch() for o in out.loss_fn_outputs])
            ]
        )
    clock, losses, first = StepClock(a["server_pid"]), [], {}
    beta, lr, N = a["beta"], a["lr"], a["steps"]
    clock.start()
    for s, ds in enumerate(batches):
        ref = torch.tensor(refs[s])

        def dpo_loss(data_, logprobs, ref=ref):
            lp = torch.stack(seq_logps(data_, logprobs))
            c, r = lp[0::2], lp[1::2]
            margin = (c - ref[0::2]) - (r - ref[1::2])
            loss = -F.logsigmoid(beta * margin).mean()
            if not first:
                first.update(chosen=float(c.mean()), rejected=float(r.mean()))
            return loss, {"dpo_loss": float(loss)}

        res = tc.forward_backward_custom(ds, dpo_loss).result()
        # TRL's linear schedule: step k (0-based) uses lr * (1 - k / N).
        tc.optim_step(types.AdamParams(learning_rate=lr * (1 - s / N), beta1=ADAM["beta1"],
                                       beta2=ADAM["beta2"], eps=ADAM["eps"])).result()  # fmt: skip
        clock.tick()
        losses.append(float(res.metrics["dpo_loss"]))
    sc.close("success").result() if hasattr(sc, "close") else None
    return {"step_times": clock.times, "cpu_marks": clock.cpu_marks, "losses": losses,
            "logps_chosen": first["chosen"], "logps_rejected": first["rejected"]}  # fmt: skip


def w_tinker_script(a: dict) -> dict:
    """The service script: LoRA client, forward_backward + optim_step per step, then a
    sampling client and `sample` (8 samples per call). Runs in any venv with the SDK."""
    import numpy as np
    import tinker
    from tinker import types

    rows = [json.loads(x) for x in Path(a["data"]).read_text().splitlines()[: a["batch"]]]
    data = []
    for r in rows:
        ids, m = r["input_ids"], r["completion_mask"]
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [float(x) for x in m[1:]]},
            )
        )
    sc, base = _tinker_client(a["url"])
    tc = sc.create_lora_training_client(base_model=base, rank=LORA["rank"], seed=0)
    train, sample, losses = StepClock(a["server_pid"]), StepClock(a["server_pid"]), []
    train.start()
    for _ in range(a["steps"]):
        fb = tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=a["lr"], beta1=ADAM["beta1"],
                                       beta2=ADAM["beta2"], eps=ADAM["eps"])).result()  # fmt: skip
        train.tick()
        lp = np.concatenate([np.asarray(o["logprobs"].tolist()) for o in fb.loss_fn_outputs])
        w = np.concatenate([np.asarray(d.loss_fn_inputs["weights"].tolist()) for d in data])
        losses.append(float(-(lp * w).sum() / w.sum()))
        train.start()  # the loss bookkeeping above is not the service's time
    sampler = tc.save_weights_and_get_sampling_client(name="peers")
    prompt = types.ModelInput.from_ints(rows[0]["input_ids"][: rows[0]["completion_mask"].index(1)])
    sample.start()
    for _ in range(a["samples"]):
        sampler.sample(prompt=prompt, num_samples=8,
                       sampling_params=types.SamplingParams(max_tokens=a["max_tokens"],
                                                            temperature=1.0)).result()  # fmt: skip
        sample.tick()
    return {"train_step_s": train.times, "train_cpu_marks": train.cpu_marks,
            "sample_s": sample.times, "sample_cpu_marks": sample.cpu_marks, "losses": losses,
            "sdk": f"tinker {tinker.__version__}"}  # fmt: skip
