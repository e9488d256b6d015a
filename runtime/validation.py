"""torchtitan's Validator, kept out of the training throughput figures.

torchtitan's `Validator.validate` adds its tokens to the metrics processor's training
counter and `log_validation` resets the counter and the interval clock. With
`metrics.log_every > 1` that would drop the training tokens of a half-finished interval and
count validation time as training time. `TitanscaleValidator` runs torchtitan's validation
unchanged, then restores the training counters and moves the interval clock forward by the
time validation took, so tokens/s, MFU and step time describe training only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch.nn as nn
from torchtitan.components.validate import Validator


class TitanscaleValidator(Validator):
    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        pass

    def validate(self, model_parts: list[nn.Module], step: int) -> None:
        mp = self.metrics_processor
        saved = {
            k: getattr(mp, k)
            for k in (
                "ntokens_since_last_log",
                "useful_ntokens_since_last_log",
                "doc_attn_pairs_since_last_log",
            )
            if hasattr(mp, k)
        }
        data_times = list(mp.data_loading_times)
        last_log = mp.time_last_log
        begin = time.perf_counter()
        super().validate(model_parts, step)
        for k, v in saved.items():
            setattr(mp, k, v)
        mp.data_loading_times[:] = data_times
        mp.time_last_log = last_log + (time.perf_counter() - begin)
