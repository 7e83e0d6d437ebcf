"""What a rollout quantizes (:class:`QuantConfig`): the paper's named rollout
configurations and the sites each makes FP4 in a model of a given
architecture, without torch, so that the run config (:mod:`tracefp4.schemas`)
checks them without loading the numerics. :mod:`.quant` quantizes there."""

from dataclasses import dataclass

from .architecture import ModelConfig

ACTIVATION_SITES = ("moe_in", "moe_down_in")
KV_SITES = ("k_cache", "v_cache")
FP4_FORMATS = ("nvfp4", "mxfp4")  # tracefp4.kernels.FORMATS, which imports torch (tests/test_schemas.py)
ACTIVATION_GLOBAL_SCALES = ("static", "per_token")


@dataclass(frozen=True)
class QuantConfig:
    """What a rollout quantizes: expert weights, expert activations, KV cache.
    ``None`` keeps a part in the compute dtype; activations may be ``"fp8"`` (W4A8)."""

    weights: str | None = None
    activations: str | None = None
    kv: str | None = None
    # QUADS-style residual activation compensation: in each row of an FP4 activation site, the
    # channels with the largest quantization error take back their exact values
    compensated_channels: int = 0
    # NVFP4 activation global scales: static per (layer, site), or per_token (one per row)
    activation_global_scale: str = "static"

    def __post_init__(self):
        if self.compensated_channels < 0:
            raise ValueError(f"compensated_channels must be >= 0, got {self.compensated_channels}")
        if self.activation_global_scale not in ACTIVATION_GLOBAL_SCALES:
            raise ValueError(
                f"activation_global_scale {self.activation_global_scale!r} is not one of {ACTIVATION_GLOBAL_SCALES}"
            )
        if self.activation_global_scale == "per_token" and self.activations != "nvfp4":
            raise ValueError(
                f"per_token activation global scales are NVFP4's; activations are {self.activations or 'BF16'}"
            )
        for part, value, allowed in [
            ("weights", self.weights, FP4_FORMATS),
            ("activations", self.activations, FP4_FORMATS + ("fp8",)),
            ("kv", self.kv, FP4_FORMATS),
        ]:
            if value is not None and value not in allowed:
                raise ValueError(f"{part} format {value!r} is not one of {allowed} (or None for BF16)")

    def site_format(self, site: str) -> str | None:
        """The FP4 format a captured site is quantized to, None if it is not FP4."""
        fmt = self.activations if site in ACTIVATION_SITES else self.kv if site in KV_SITES else self.weights
        return fmt if fmt in FP4_FORMATS else None

    def fp4_sites(self, cfg: ModelConfig, layer: int) -> list[str]:
        """The captured sites of ``layer`` that are FP4 here (what a rollout records
        there): expert activations in a routed-MoE layer, the KV cache in a
        full-attention one."""
        return [
            site
            for site in ACTIVATION_SITES + KV_SITES
            if self.site_format(site) is not None
            and (cfg.is_sparse(layer) if site in ACTIVATION_SITES else not cfg.is_linear(layer))
        ]

    def fp4_layers(self, cfg: ModelConfig) -> list[int]:
        """The layers with an FP4 site (:meth:`fp4_sites`): the ones guidance can cover."""
        return [layer for layer in range(cfg.num_layers) if self.fp4_sites(cfg, layer)]

    def per_token(self, site: str) -> bool:
        """Whether ``site`` takes one NVFP4 global scale per row, computed from the row."""
        return self.activation_global_scale == "per_token" and site in ACTIVATION_SITES


ROLLOUT_CONFIGS = ("bf16", "fp4_wa", "fp4_kv", "fp4_wa_kv", "w4a8_mxfp4_kv", "w4a4_mxfp4_kv")
BF16 = QuantConfig()  # nothing quantized


def rollout_config(name: str, fmt: str = "nvfp4") -> QuantConfig:
    """The paper's rollout configurations; ``fmt`` is the FP4 format of W/A (and of KV where it is FP4 KV)."""
    configs = {
        "bf16": BF16,
        "fp4_wa": QuantConfig(fmt, fmt, None),
        "fp4_kv": QuantConfig(None, None, fmt),
        "fp4_wa_kv": QuantConfig(fmt, fmt, fmt),
        "w4a8_mxfp4_kv": QuantConfig(fmt, "fp8", "mxfp4"),
        "w4a4_mxfp4_kv": QuantConfig(fmt, fmt, "mxfp4"),
    }
    if name not in configs:
        raise ValueError(f"unknown rollout config {name!r}; expected one of {ROLLOUT_CONFIGS}")
    return configs[name]


def quant_sites(cfg: ModelConfig, q: QuantConfig) -> list[tuple[int, str]]:
    """Every ``(layer, site)`` that ``q`` quantizes in a model of ``cfg``."""
    out = []
    for layer in range(cfg.num_layers):
        if cfg.is_sparse(layer):
            out += [(layer, "expert_weights")] if q.weights else []
            out += [(layer, s) for s in ACTIVATION_SITES] if q.activations else []
        out += [(layer, s) for s in KV_SITES] if q.kv and not cfg.is_linear(layer) else []
    return out
