"""APOLLO and GaLore (apollo-torch, galore-torch): their projector state made savable."""
from __future__ import annotations

import torch

from maximus.train.optimizers.composite import with_flat_state


class _ProjectorState:
    """APOLLO's and GaLore's per-weight projector objects as ``projector/<attribute>`` entries."""

    def flat_state(self, p, st: dict) -> dict:
        out = {k: v for k, v in st.items() if k != "projector"}
        projector = st.get("projector")
        if projector is not None:
            for attr, value in vars(projector).items():
                if value is not None:
                    out[f"projector/{attr}"] = value
        return out

    def unflat_state(self, p, live: dict, extra: dict) -> None:
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        projector = self.new_projector(group, live)
        for key, value in extra.items():
            attr = key.split("/", 1)[1]
            if isinstance(value, torch.Tensor):
                value = value.to(p.device)
            setattr(projector, attr, value)
        live["projector"] = projector


def apollo_class():
    from apollo_torch import APOLLOAdamW

    class APOLLO(_ProjectorState, APOLLOAdamW):
        def new_projector(self, group, state):
            return self._initialize_projector(group, state)

    return with_flat_state(APOLLO)


def galore_class():
    from galore_torch import GaLoreAdamW
    from galore_torch.galore_projector import GaLoreProjector

    class GaLore(_ProjectorState, GaLoreAdamW):
        def new_projector(self, group, state):
            return GaLoreProjector(group["rank"], update_proj_gap=group["update_proj_gap"], scale=group["scale"],
                                   proj_type=group["proj_type"])

    return with_flat_state(GaLore)
