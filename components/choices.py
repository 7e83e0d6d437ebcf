"""What a run chooses among, without torch: the training methods, the PTQ
baselines, the training precisions, the device, and which numbers of training
processes can split an RL step. Each is defined here once, for the module
that acts on the choice (:mod:`.qat`, :mod:`.ptq`, :mod:`.precision`,
:mod:`.device`, :mod:`.distributed`) and for the run config
(:mod:`tracefp4.schemas`), which then loads without torch: the ``tracefp4``
command starts in a fraction of the seconds torch takes to import."""

from .quant_config import QuantConfig

METHODS = ("bf16", "qat", "quads", "trace", "tis_sc")  # how training treats the quantization sites (.qat)
# the methods whose training path quantizes what a rollout captures (activations, KV): whose FP4 codes can be
# compared with the rollout's (bf16 and tis_sc keep every site as it is, quads fake-quantizes the weights alone)
QUANTIZING_CAPTURED_SITES = ("qat", "trace")
PTQ_METHODS = ("nvfp4", "four_over_six", "h_scale")  # post-training quantization baselines (.ptq)
PRECISIONS = ("bf16", "fp32_master")  # of the policy's weights in training (.precision)
DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"  # resources.device (.device.resolve)


def scored_under(quant: QuantConfig) -> bool:
    """Whether evaluation scores the PTQ baselines under rollout config ``quant``:
    they are NVFP4 weights, so only where the config's own weights are NVFP4
    does a row compare the trained policy with PTQ at the same weight format."""
    return quant.weights == "nvfp4"


def uneven_split(microbatches: int, group: int, world: int) -> str | None:
    """Why ``world`` processes cannot train an RL step of ``microbatches``
    microbatches with an optimizer step every ``group`` of them, or None where
    they can. Each optimizer step's group (the last may hold fewer) is cut into
    ``world`` equal runs, one a process, so that every process takes part in
    every optimizer step's collectives (:func:`.distributed.rank_microbatches`):
    the size of each group must be a multiple of ``world``. That is
    ``microbatches`` a multiple of ``world``, and ``group`` one too unless it
    holds the whole step (every 5 of 4 microbatches: one group of 4)."""
    full, last = min(group, microbatches), microbatches % group if group < microbatches else 0
    if full % world == 0 and last % world == 0:
        return None
    groups = f"groups of {full}" + (f" and a last one of {last}" if last else "")
    return (
        f"an RL step's {microbatches} microbatches with an optimizer step every {group} make {groups}: each "
        f"group must be a multiple of the {world} training processes"
    )
