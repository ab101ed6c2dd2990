"""`bench bw --validate`: decode for real with each backend on a synthetic model, check the pick."""

from __future__ import annotations

from typing import Any

from freetoken.runtime.measure.bandwidth import ExpertShape
from freetoken.runtime.measure.profile import BandwidthProfile


def validate_recommendation(
    profile: BandwidthProfile,
    shape: ExpertShape,
    layers: int = 4,
    cache_ratio: float = 0.37,
    tokens: int = 48,
) -> dict[str, Any]:
    import torch

    from freetoken.replay.synthetic import decode_steps, spec_for_experts, synthetic_engine, uniform_routing
    from freetoken.runtime.config import MoeConfig

    cuda = torch.cuda.is_available()
    backends = ("offload", "cpu", "hybrid") if cuda else ("cpu",)
    spec = spec_for_experts(shape.hidden, shape.intermediate, shape.top_k, shape.num_experts, layers)
    pcie = profile.b_p / 1e9 if profile.b_p else None
    engine = synthetic_engine(
        spec, "cuda" if cuda else "cpu", MoeConfig("cpu", cache_size=0, reprofile=False), dtype="bfloat16"
    )
    uniform_routing(engine)
    tok_s = {}
    for backend in backends:
        ratio = cache_ratio if backend != "cpu" or cuda else None
        engine.configure_moe(
            MoeConfig(
                backend, cache_ratio=ratio, pcie_gbps=pcie, host_gbps=profile.b_h / 1e9, reprofile=False
            )
        )
        tok_s[backend] = 1.0 / decode_steps(engine, warm=8, tokens=tokens)
    engine.close()
    fastest = max(tok_s, key=tok_s.get)
    # within 3% counts as a tie: the decode is short and the machine is not quiet
    agrees = tok_s.get(profile.recommended_backend, 0.0) >= 0.97 * tok_s[fastest]
    return {
        "layers": layers,
        "cache_ratio": cache_ratio,
        "tokens": tokens,
        "tok_s": tok_s,
        "fastest": fastest,
        "recommended": profile.recommended_backend,
        "agrees": agrees,
    }
