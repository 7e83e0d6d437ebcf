"""The run configuration: every knob of a tracefp4 run in one validated tree.

One `RunConfig` travels from the CLI through the Kubeflow pipeline into each
component (as JSON), so a typo or an out-of-range value fails when the run is
submitted, not hours into it. Every model forbids unknown fields; every field
has a type, bounds, a description and a default. Field names follow the
library (`components/`): rollout config names, layer selections and sites mean
what docs/rollout.md and docs/guidance-format.md say.

Every set of names (presets, rollout configs, formats, methods, tasks, PTQ
baselines) is derived from the library's own registry, so a value the schema
accepts is one the library runs.
"""

import re
from types import NoneType, UnionType
from typing import Annotated, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from tracefp4.components import architecture, choices, quant_config, tasks
from tracefp4.components.choices import DEVICE_PATTERN, uneven_split
from tracefp4.components.store import CA_BUNDLE_ENV, ENDPOINT_ENV, REGION_ENV, file_path, parse_s3_uri
from tracefp4.components.syndrome_rate import (
    BLOCK_ELEMENTS,
    MAX_CODE_BITS,
    MAX_SCALE_BITS,
    MIN_CODE_BITS,
    MIN_SCALE_BITS,
    scale_bits_cap,
)

ModelPreset = Literal[tuple(architecture.PRESETS)]
RolloutConfigName = Literal[quant_config.ROLLOUT_CONFIGS]
FP4Format = Literal[quant_config.FP4_FORMATS]
ActivationGlobalScale = Literal[quant_config.ACTIVATION_GLOBAL_SCALES]
# rollout configs whose routed-expert activations are FP4 (the others: BF16 or FP8)
FP4_ACTIVATION_CONFIGS = tuple(
    n for n in quant_config.ROLLOUT_CONFIGS if quant_config.rollout_config(n).activations in quant_config.FP4_FORMATS
)
Method = Literal[choices.METHODS]
TaskName = Literal[tuple(tasks.TASKS)]
PTQMethod = Literal[choices.PTQ_METHODS]
Schedule = Literal["on_policy", "off_policy"]
Precision = Literal[choices.PRECISIONS]

# The only source of the S3 credentials; the store backend reads the same names.
SECRET_ENV = {"access_key": "TRACEFP4_S3_ACCESS_KEY", "secret_key": "TRACEFP4_S3_SECRET_KEY"}
# The Kubernetes secret `store.secret_name` in KFP's MinIO layout: its key -> the variable a step reads.
SECRET_KEYS = {"accesskey": SECRET_ENV["access_key"], "secretkey": SECRET_ENV["secret_key"]}
# The Kubernetes secret `store.ca_bundle_secret`: the key holding the CA bundle, and the folder every step and rank pod
# mounts the secret at; SSL_CERT_FILE names the file (StoreConfig.pod_environment)
CA_BUNDLE_KEY, CA_BUNDLE_MOUNT = "ca.crt", "/etc/tracefp4/store-ca"

# Dotted paths of the settings that only shape a cluster run's pods (their image, resources, placement and labels,
# the Kubernetes secrets mounted for the store's credentials and CA bundle) or reach only the cluster's APIs (a
# TrainJob's runtime and its wait for Kueue's quota, the KFP API a chained run submits its next run through). No
# step of a local run reads them: the train step reads the pods' settings only to create a TrainJob, which a local
# run refuses, and the chain step, which reads kfp_host, ends only a chained run, which a local run never is. A
# local run leaves them at their defaults (RunConfig.without_cluster_only), so that a rerun that changes one reuses
# every finished task. resources.device is not one: every step computes on it.
CLUSTER_ONLY = (
    "image",
    "kfp_host",
    "resources.cpu",
    "resources.memory",
    "resources.host_cpu",
    "resources.host_memory",
    "resources.gpus",
    "resources.accelerator_type",
    "resources.node_selector",
    "resources.tolerations",
    "resources.labels",
    "store.secret_name",
    "store.ca_bundle_secret",
    "train.trainjob_runtime",
    "train.queue_timeout_seconds",
)

STORE_URI_PATTERN = r"^(file|s3|minio)://\S+$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-.a-z0-9]{0,251}[a-z0-9])?$"
HTTP_URL = r"^https?://\S+$"
HTTP_ENDPOINT = r"^https?://[^\s/@]+(:[0-9]+)?/?$"  # scheme, host and port: nothing else
S3_REGION = r"^[A-Za-z0-9][-_A-Za-z0-9]{0,62}$"  # AWS's us-east-1, MinIO's and Ceph's own names, R2's auto
K8S_CPU = r"^([0-9]+(\.[0-9]+)?|[0-9]+m)$"
TASK_NAME = r"^[a-z][a-z0-9_-]{0,62}$"  # a task's name is a metrics label value and a report's row
SHA256 = r"^[0-9a-f]{64}$"
RESERVED_TASK_NAMES = ("all", "avg")  # the training mix's metrics label, the report's average columns
KEY_PATH = r"^[^.]+(\.[^.]+)*$"  # a JSON key, or a dotted path of them into nested objects
REWARD_FUNCTION = r"^\S+\.py:[A-Za-z_][A-Za-z0-9_]*$"  # a Python file's path or store URI, then a function in it
# what KFP's set_memory_limit takes: a whole number, no Kubernetes decimals or lowercase k
K8S_MEMORY = r"^[0-9]+(Ki|Mi|Gi|Ti|Pi|Ei|K|M|G|T|P|E)?$"
_IMAGE_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"  # a path component of an image name
# [registry[:port]/]path[:tag][@sha256:digest], as the OCI distribution spec writes references
IMAGE = (
    rf"^(?:[A-Za-z0-9.-]+(?::[0-9]+)?/)?{_IMAGE_PART}(?:/{_IMAGE_PART})*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$"
)
# a Kubernetes label key: an optional DNS-subdomain prefix and '/', then a name of up to 63 characters
LABEL_KEY = r"^([a-z0-9]([-.a-z0-9]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
LABEL_VALUE = r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$"
# What each pattern means, for error messages (ConfigError) instead of the bare regex.
PATTERN_HINTS = {
    DNS_LABEL: "must be a DNS label: lowercase letters, digits and '-', 1-63 characters, alphanumeric at both ends",
    DNS_SUBDOMAIN: "must be a Kubernetes object name: lowercase letters, digits, '-', '.', alphanumeric at both ends",
    HTTP_URL: "must be an http:// or https:// URL such as 'http://host:9091'",
    HTTP_ENDPOINT: "must be an http:// or https:// endpoint, scheme, host and port alone: 'http://minio:9000'",
    S3_REGION: "must be an S3 region name such as 'us-east-1': letters, digits, '-' and '_', 1-63 characters",
    K8S_CPU: "must be a Kubernetes CPU quantity such as '2', '0.5' or '500m'",
    K8S_MEMORY: "must be a memory quantity KFP takes: a whole number with an optional suffix Ki, Mi, Gi, Ti, Pi, Ei, "
    "K, M, G, T, P or E, such as '8Gi', '512Mi' or '1G'",
    IMAGE: "must be a container image reference such as 'ghcr.io/org/name:tag' (lowercase name)",
    LABEL_KEY: "must be a Kubernetes label key: [prefix/]name, the name up to 63 letters, digits, '-', '_', '.', "
    "alphanumeric at both ends",
    LABEL_VALUE: "must be a Kubernetes label value: up to 63 letters, digits, '-', '_', '.', alphanumeric at both ends",
    DEVICE_PATTERN: "must be 'auto', 'cpu', 'cuda' or 'cuda:N'",
    TASK_NAME: "must be a task name: lowercase letters, digits, '_' and '-', 1-63 characters, a letter first",
    SHA256: "must be a sha256 digest: 64 lowercase hexadecimal digits",
    KEY_PATH: "must be a JSON key, or keys and list item numbers joined by '.' into nested objects and lists (such "
    "as 'reward_model.ground_truth' or 'prompt.0.content')",
    REWARD_FUNCTION: "must be a Python file and a function in it, FILE.py:FUNCTION (such as rewards.py:score or "
    "s3://bucket/rewards.py:score)",
}

LabelKey = Annotated[str, StringConstraints(pattern=LABEL_KEY, max_length=317)]
LabelValue = Annotated[str, StringConstraints(pattern=LABEL_VALUE)]


class _Section(BaseModel):
    """Shared settings: unknown fields are errors, assignments are validated,
    and a number is never a boolean."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_number(cls, value: object, info: ValidationInfo) -> object:
        """Refuse true or false for a number: pydantic takes them as 1 and 0, so
        ``rl.rounds: true`` ran one round and ``rollout.temperature: true`` sampled at 1.0."""
        if isinstance(value, bool) and _numeric(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"must be a number, not {str(value).lower()}")
        return value


def _numeric(annotation: object) -> bool:
    """Whether a field of type ``annotation`` holds a number (int or float, optional or constrained), nothing else."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, UnionType):
        members = [a for a in get_args(annotation) if a is not NoneType]
        return bool(members) and all(_numeric(a) for a in members)
    return annotation in (int, float)


def _one_layer_error(value: object, handler):
    """Collapse the union's per-member errors into one readable reason."""
    try:
        value = handler(value)
    except ValidationError:
        raise PydanticCustomError(
            "layer_selection",
            "expected 'all', a positive int N (the deepest N layers) or a list of layer indices >= 0",
        ) from None
    if isinstance(value, list):
        if len(set(value)) != len(value):
            raise PydanticCustomError("layer_selection", "layer indices must be distinct")
        return sorted(value)
    return value


LayerSelection = Annotated[
    Literal["all"]
    | Annotated[int, Field(strict=True, ge=1)]
    | Annotated[list[Annotated[int, Field(strict=True, ge=0)]], Field(min_length=1)],
    WrapValidator(_one_layer_error),
]


def _check_store_uri(uri: str) -> str:
    """The schemes `components/store.py:open_store` serves, each URI read as its store
    reads it (:func:`~tracefp4.components.store.file_path`, :func:`~tracefp4.components.store.parse_s3_uri`)."""
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in ("file", "s3", "minio") or not rest or re.search(r"\s", uri):
        raise PydanticCustomError("store_uri", "must start with file://, s3:// or minio:// followed by a location")
    try:  # as the store will read it (an S3 URI's message never echoes credentials)
        file_path(uri) if scheme == "file" else parse_s3_uri(uri)
    except ValueError as e:
        raise PydanticCustomError("store_uri", "{problem}", {"problem": str(e)}) from None
    return uri


class ModelConfig(_Section):
    """The policy: a seeded library preset or a Hugging Face checkpoint, exactly one."""

    preset: ModelPreset | None = Field(
        default=None, description="Library preset with seeded random weights (no download); exclusive with checkpoint."
    )
    checkpoint: str | None = Field(
        default=None,
        min_length=1,
        description="Path or store URI (file://, s3://, minio://) of a Hugging Face qwen3_moe/qwen2_moe/"
        "qwen3_5_moe folder (config.json, safetensors, tokenizer.json, tokenizer_config.json, the chat template's "
        "chat_template.jinja where the template is not in tokenizer_config.json, optional generation_config.json; "
        "docs/pipeline.md); exclusive with preset, which a layer of settings naming it drops.",
    )
    trainer_state: str | None = Field(
        default=None,
        min_length=1,
        description="Path or store URI of the trainer state a continuation goes on from: the new_trainer_state of "
        "the last train task of the run it continues, whose new_policy is model.checkpoint. The optimizer's "
        "moments, master weights and step go on as they were; needs rl.first_round (docs/deploy.md, 'Known "
        "limit'). None: a new run, with a fresh optimizer.",
    )
    dtype: Literal["bfloat16", "float32"] = Field(default="float32", description="Compute dtype of the rollout policy.")
    max_seq_len: int = Field(default=512, ge=8, le=1 << 20, description="Longest prompt + response, in tokens.")

    @field_validator("checkpoint", "trainer_state")
    @classmethod
    def _checkpoint_scheme(cls, value: str | None) -> str | None:
        return value if value is None or "://" not in value else _check_store_uri(value)

    @model_validator(mode="after")
    def _exactly_one(self) -> "ModelConfig":
        if (self.preset is None) == (self.checkpoint is None):
            state = "both are set" if self.preset is not None else "neither is set"
            raise ValueError(f"set exactly one of model.preset and model.checkpoint ({state})")
        return self


class RolloutConfig(_Section):
    """FP4 rollout engine settings and sampling (docs/rollout.md)."""

    fmt: FP4Format = Field(default="nvfp4", description="FP4 format of the quantized rollout sites.")
    config: RolloutConfigName = Field(
        default="fp4_wa_kv", description="Which sites the rollout quantizes (components.quant_config.rollout_config)."
    )
    temperature: float = Field(
        default=1.0,
        ge=0.01,
        le=10.0,
        description="Sampling temperature of the rollouts (greedy ones would make a group's responses alike, and "
        "every advantage 0; evaluation scores greedily besides). At least 0.01: below it sampling is greedy in all "
        "but name, and near 1e-38 logits / temperature overflow float32 and the policy trains to NaN.",
    )
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1 disables it.")
    top_k: int = Field(default=0, ge=0, le=1 << 20, description="Top-k sampling; 0 disables it.")
    max_new_tokens: int = Field(default=64, ge=1, le=1 << 20, description="Response length limit, in tokens.")
    group_size: int = Field(
        default=4,
        ge=2,
        le=1024,
        description="Responses sampled per prompt (the advantage group: GRPO compares them, so at least 2).",
    )
    prompts_per_step: int = Field(
        default=8, ge=1, le=65536, description="Prompts rolled out per RL step. Bounded: held in memory at once."
    )
    max_tokens_per_forward: int = Field(
        default=4096,
        ge=1,
        le=1 << 22,
        description="Rows of each capture buffer (token rows per forward before offload): a capturing rollout "
        "runs as many prompts at once as their padded prefill fits, the others taking the rows of finished ones. "
        "Bounded: held in memory at once.",
    )
    max_running_requests: int = Field(
        default=0,
        ge=0,
        le=1 << 20,
        description="Requests one rollout worker (or evaluation) decodes at once; the rest wait, in order, each "
        "prefilled into the row of a finished one at a stop check (continuous batching), with the same responses. "
        "0: all of an RL step's share at once. Bounds what decoding holds on the device: the KV cache and the "
        "linear-attention states of that many requests (about 64 MB of states per sequence on Qwen3.5-35B-A3B).",
    )
    workers: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Rollout tasks per round, each with its own engine and capture shards, run in parallel "
        "(dsl.ParallelFor); each takes a contiguous share of every RL step's prompts. Every response is seeded by "
        "its place in the round, so any number of workers rolls out the same trajectories as one: bit for bit on "
        "a CPU; a GPU's kernels may sum a row in an order that depends on the batch's shape, which can move a "
        "response's last bits (docs/rollout.md).",
    )
    activation_global_scale: ActivationGlobalScale = Field(
        default="static",
        description="NVFP4 global scales of the routed-expert activations, as serving engines set them: static, "
        "one per layer and site calibrated at every weight sync (a checkpoint's input_scale, SGLang modelopt_fp4); "
        "per_token, one per token row, amax(row) / (6 * 448) at run time (FlashInfer's per-token NVFP4, SGLang "
        "nvfp4_online). Training reproduces it: RTN from its own rows, trace from the rollout's captured scales. "
        "Needs NVFP4 activations (rollout.fmt nvfp4, a config with FP4 activations) and guidance.codec bits. "
        "Weights and the KV cache keep static scales. A pipeline refuses per_token when it is built: its final "
        "export cannot express it (compressed-tensors keeps one input global scale per module); the steps and "
        "benchmarks/repro.py run it.",
    )
    quads_compensated_channels: int = Field(
        default=8,
        ge=0,
        le=1 << 20,
        description="QUADS' rollout-side residual activation compensation, used by method quads only: in each "
        "row of an FP4 activation site (a token, or at moe_down_in a token's expert slot), this many channels "
        "with the largest quantization error keep their exact values (as many as a row has or more: all of them).",
    )


class GuidanceConfig(_Section):
    """What rollout guidance is kept and how it reaches training (docs/guidance-format.md)."""

    bits: int = Field(default=1, ge=1, le=4, description="Low bits kept per FP4 code: R-kbit (4 keeps the whole code).")
    layers: LayerSelection = Field(
        default="all",
        description="Layers guided, of those with FP4 sites under the rollout config: 'all', N (the deepest N) "
        "or a list of layer indices. Coverage decides alignment more than bit depth (docs/results.md): a mismatch "
        "left in one layer cascades into the next.",
    )
    compaction: Literal["inline", "offline"] = Field(
        default="inline", description="Truncate codes during capture (inline) or after a full capture (offline)."
    )
    codec: Literal["bits", "syndrome"] = Field(
        default="bits",
        description="bits: the low bits of every code and the block scales as they are (R-kbit). syndrome: R-1 "
        "guidance as parity bits the training side decodes with its own values, ~0.3 bit per element with scales "
        "(docs/guidance-format.md); needs bits 1.",
    )
    syndrome_rate: float = Field(
        default=0.25,
        ge=(MIN_CODE_BITS + MIN_SCALE_BITS) / BLOCK_ELEMENTS,
        le=(MAX_CODE_BITS + MAX_SCALE_BITS) / BLOCK_ELEMENTS,
        description="syndrome codec: bits per captured element (scales included) of a run's first step; later "
        "steps choose each layer's and site's rate from the previous step's decode statistics. A block of 256 "
        "elements takes whole bytes (the rate rounds up in steps of 1/32), at least 16 code and 8 scale bits "
        "(0.09375) and at most 64 code bits and its scales' own bits (0.3125 for NVFP4's 16 scales; MXFP4's 8 "
        "make 0.28125).",
    )
    trajectories_per_shard: int = Field(default=64, ge=1, le=65536, description="Trajectories per guidance shard file.")
    prefetch_microbatches: int = Field(default=2, ge=1, le=64, description="Microbatches of guidance loaded ahead.")
    allow_rtn_fallback: bool = Field(
        default=False, description="Round a trajectory without guidance RTN (counted) instead of failing."
    )
    keep_steps: bool = Field(
        default=False,
        description="Keep every round's guidance and capture in the store until `tracefp4 runs clean` (for audits "
        "or re-running a compaction). Off, round r's train deletes round r-1's once it has saved its outputs, so "
        "that the store holds about two rounds of them at once: at the paper presets a round's guidance is "
        "terabytes (`tracefp4 plan`).",
    )


Beta = Annotated[float, Field(ge=0.0, lt=1.0)]


class RLConfig(_Section):
    """The RL loop and its optimizer: rounds of steps, a clipped policy-gradient loss."""

    schedule: Schedule = Field(
        default="on_policy",
        description="on_policy: every rollout batch is trained by one optimizer step and the next batch comes from "
        "the updated policy (needs steps_per_round 1 and grad_accumulation 0). off_policy: a round rolls out "
        "steps_per_round batches from one policy, then trains on them in turn, so batch s is s optimizer steps "
        "stale; truncated importance sampling (tis_cap) corrects for it (docs/training.md).",
    )
    steps_per_round: int = Field(
        default=1, ge=1, le=1024, description="RL steps (rollout batches) per round: rollout -> compaction -> train."
    )
    rounds: int = Field(
        default=2,
        ge=1,
        le=200,
        description="Rounds of training; each is three pipeline tasks. Rounds are unrolled "
        "into the DAG (rl.rounds_per_run of them a run, where set): 200 rounds compile in about 20 s, and more "
        "steps fit in off_policy rounds. Evaluation runs once a run, after its last round.",
    )
    first_round: int = Field(
        default=0,
        ge=0,
        le=1 << 20,
        description="Index of the run's first round: 0 for a new run; a continuation (model.trainer_state) sets "
        "the rounds the runs before it took, so that its rounds draw the prompts and seeds that come next.",
    )
    rounds_per_run: int = Field(
        default=0,
        ge=0,
        le=200,
        description="Rounds one cluster run executes (0: all of them). A KFP run holds about 15 rounds "
        "(docs/deploy.md, 'Known limit'): with more, the run's last task submits the next run, which continues it "
        "for the rounds left (rl.first_round on, model.checkpoint and model.trainer_state its last train task's), "
        "and so on until rl.rounds are done; a local run executes every round.",
    )
    learning_rate: float = Field(default=1e-4, gt=0.0, le=1.0, description="AdamW learning rate.")
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0, description="AdamW decoupled weight decay.")
    grad_clip: float = Field(default=1.0, ge=0.0, description="Global gradient-norm clip; 0 disables it.")
    microbatch_size: int = Field(
        default=8, ge=1, le=65536, description="Trajectories per training microbatch. Bounded: held in memory at once."
    )
    grad_accumulation: int = Field(
        default=0,
        ge=0,
        le=1 << 20,
        description="Microbatches per optimizer step; 0: all of a step's microbatches (one "
        "optimizer step per rollout batch).",
    )
    ppo_clip: float = Field(default=0.2, gt=0.0, le=1.0, description="PPO ratio clip epsilon.")
    tis_cap: float = Field(
        default=2.0,
        ge=1.0,
        le=1e6,
        description="Truncated importance sampling cap C: weight min(pi_old / pi_rollout, C).",
    )
    kl_coef: float = Field(
        default=0.0,
        ge=0.0,
        le=1e3,
        description="k3 KL penalty to the policy the round started from (the rollout's, in training numerics); 0 "
        "disables it. Needs more than one optimizer step a round (off_policy with steps_per_round > 1 or "
        "grad_accumulation > 0): a round of one trains that very policy, so the penalty would be 0.",
    )
    adam_betas: tuple[Beta, Beta] = Field(default=(0.9, 0.999), description="AdamW (beta1, beta2).")
    measure_mismatch: bool = Field(
        default=False,
        description="Compare the training path's FP4 codes with the rollout's at every step (per-layer code "
        "mismatch, codeword-difference histogram). The rollout then keeps a full 4-bit capture and trace compacts "
        "it offline, so it needs guidance.compaction offline.",
    )

    def run_rounds(self) -> range:
        """The round indices one run executes: from ``first_round``, every
        round, or ``rounds_per_run`` of them when a chain of runs takes the rest."""
        return range(self.first_round, self.first_round + min(self.rounds, self.rounds_per_run or self.rounds))

    @property
    def rounds_left(self) -> int:
        """The rounds left after one run: where there are any, its last task submits the next run."""
        return self.rounds - len(self.run_rounds())

    @property
    def chained(self) -> bool:
        return self.rounds_left > 0


class TrainSection(_Section):
    """How and where guided QAT runs (docs/training.md): its numerics, and one
    process in the train step or several under torch.distributed (FSDP2)
    launched as docs/deploy.md says. Named apart from the library's
    ``components.trainer.TrainConfig``, the optimizer's hyperparameters (``rl``)."""

    precision: Precision | None = Field(
        default=None,
        description="bf16: bf16 parameters and a bf16 forward (residual stream, norms, RoPE: as the rollout's bf16 "
        "policy computes), AdamW over float32 master weights and moments, the parameters the master rounded after "
        "each step: how Megatron (bf16, distributed optimizer) and FSDP2 (MixedPrecisionPolicy) train, and the "
        "numerics closest to a bf16 rollout. fp32_master: float32 parameters under autocast to the rollout's dtype "
        "(the residual stream, norms and RoPE stay float32): against a bf16 rollout more FP4 codes flip between "
        "training and rollout (docs/results.md); against a float32 one, the same numerics. None: the rollout's, "
        "bf16 for a bfloat16 model.dtype and fp32_master for float32, and fp32_master for several training "
        "processes. Either way the master weights are saved with the optimizer state.",
    )
    activation_checkpointing: bool = Field(
        default=False,
        description="Keep each layer's input alone and compute the layer again in the backward, instead of keeping "
        "its activations: about a third more compute for the activations of one layer at a time. Long sequences "
        "of a large policy need it (docs/training.md).",
    )
    nodes: int = Field(
        default=1, ge=1, le=1024, description="Machines the train step trains on; more than 1 needs launcher trainjob."
    )
    processes_per_node: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Training processes per machine (one per GPU on a GPU node). nodes x processes_per_node = 1 "
        "trains in the train step's own process; more shard the weights, gradients and optimizer state (FSDP2) "
        "and split each RL step's microbatches over the processes, which must divide them evenly; more than 1 "
        "needs precision fp32_master.",
    )
    launcher: Literal["torchrun", "trainjob"] = Field(
        default="torchrun",
        description="How the train step starts more than one process: torchrun (inside the train step's own "
        "container or, for a local run, on this machine; one node) or trainjob (a Kubeflow Trainer TrainJob on "
        "the cluster, runtime trainjob_runtime; needs Kubeflow Trainer installed, docs/deploy.md).",
    )
    trainjob_runtime: str = Field(
        default="torch-distributed",
        pattern=DNS_SUBDOMAIN,
        description="The Kubeflow Trainer ClusterTrainingRuntime a TrainJob runs on.",
    )
    timeout_seconds: int = Field(
        default=600,
        ge=10,
        le=86400,
        description="How long a training process waits for the others at a collective before failing the step "
        "(a rank that died or hangs); also how long a TrainJob may stay without progress before it is failed, "
        "and its ranks wait for the round's inputs without upload progress (docs/deploy.md).",
    )
    queue_timeout_seconds: int = Field(
        default=86400,
        ge=60,
        le=30 * 86400,
        description="How long a TrainJob may wait in its Kueue queue for quota (not admitted yet, or evicted) "
        "before the step fails; the step's log says what Kueue says of it meanwhile (docs/deploy.md).",
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node

    @property
    def ranks_in_pod(self) -> bool:
        """Whether torchrun runs several ranks in the train step's own pod (a
        training node's GPUs and a shared /dev/shm there)."""
        return self.launcher == "torchrun" and self.world_size > 1

    @property
    def in_trainjob(self) -> bool:
        """Whether the ranks run in a TrainJob, the train step only launching it:
        one process trains in the step itself, whatever the launcher."""
        return self.launcher == "trainjob" and self.world_size > 1


# a LaTeX command that YAML's double quotes read as a tab (\text, \times) or a newline (\neq, \nabla) and the rest
# of its name: a template holds the tab or newline that the control characters' check lets through
_ESCAPED_COMMAND = re.compile(
    r"\t(?:ext(?:bf|it|rm|style)?|imes|heta|frac|ilde|riangle|herefore|binom)(?![A-Za-z])"
    r"|\n(?:eq|abla|eg|exists|ewline|otin)(?![A-Za-z])"
)
# a file task's settings of how its lines are read and scored, each held at its default by a generated family
FILE_SETTINGS = ("prompt_key", "answer_key", "prompt_template", "reward")


class TaskConfig(_Section):
    """One verifiable task in the training/evaluation mix: a generated family, or a user's problems from a file."""

    name: str = Field(
        pattern=TASK_NAME,
        description=f"A generated task family ({', '.join(tasks.TASKS)}), or, with data, the name of the file's "
        "problems (lowercase letters, digits, _ and -; none of the families'): the task's name in evaluation, "
        "metrics and the report.",
    )
    data: str | None = Field(
        default=None,
        min_length=1,
        description="Problems read from a file instead of generated: a path (on the machine that runs the steps: "
        "a cluster's pods read it in their image) or a store URI (file://, s3://, minio://; S3 reached with the "
        "run store's settings) of JSON Lines, an object a line with a prompt string and an answer (a string or "
        "number, what a \\boxed{} holds) at prompt_key and answer_key. A response scores 1 when its final answer "
        "(after the thinking: a response that is an answer alone, else its last \\boxed{}, else its last expression) "
        "equals the answer mathematically (math-verify; docs/evaluation.md, 'Your own problems').",
    )
    sha256: str | None = Field(
        default=None,
        pattern=SHA256,
        description="The sha256 of data's bytes: a file with other bytes is refused. Where empty, the run's first "
        "task (a local run: before it starts) sets it, so that every step reads the problems the run started with.",
    )
    prompt_key: str = Field(
        default="prompt",
        pattern=KEY_PATH,
        max_length=256,
        description="With data: the key of a line's prompt, or keys and list item numbers joined by '.' into nested "
        "objects and lists (MATH-500's problem, AIME's Problem, verl's prompt.0.content: its chat's first message).",
    )
    answer_key: str = Field(
        default="answer",
        pattern=KEY_PATH,
        max_length=256,
        description="With data: the key of a line's answer, or keys and list item numbers joined by '.' (verl's "
        "reward_model.ground_truth).",
    )
    prompt_template: str = Field(
        default=tasks.PROMPT_SLOT,
        max_length=65536,
        description=f"With data: what the policy is given, this text with {tasks.PROMPT_SLOT} (once) replaced by the "
        f"line's prompt (such as '{tasks.PROMPT_SLOT} Put the final answer in \\boxed{{}}.').",
    )
    reward: str | None = Field(
        default=None,
        pattern=REWARD_FUNCTION,
        max_length=2048,
        description="With data: a reward of your own instead of math-verify's, FILE.py:FUNCTION, the file a path "
        "or store URI as data's; called as FUNCTION(response, answer, line) with the response's text, the "
        "answer and the line's whole object, it returns a number from 0 to 1, 1 counted solved "
        "(docs/evaluation.md, 'A reward of your own').",
    )
    reward_sha256: str | None = Field(
        default=None,
        pattern=SHA256,
        description="The sha256 of reward's file: as sha256 is data's, set by the run's first task where empty.",
    )
    reward_timeout_s: float = Field(
        default=60.0,
        gt=0.0,
        le=86400.0,
        description="With reward: the seconds one call of its function may run; a call that runs longer stops the "
        "step, naming the line of the function it was at (a function that never returns would hold the step, "
        "and the run's GPUs, without a word).",
    )
    difficulty: int = Field(
        default=1, ge=1, le=5, description="Difficulty level, 1 (easiest) to 5, of a generated family (1 with data)."
    )
    train_size: int = Field(
        default=256,
        ge=0,
        le=1_000_000,
        description="Training prompts drawn; 0: a task evaluated on and never trained on (a benchmark such as "
        "AIME's problems). Bounded: held in memory at once.",
    )
    test_size: int = Field(
        default=32,
        ge=0,
        le=1_000_000,
        description="Held-out test prompts drawn; 0: a task trained on and not evaluated on (the other tasks' "
        "test prompts evaluate the run). Bounded: held in memory at once.",
    )
    weight: float = Field(
        default=1.0,
        gt=0.0,
        le=1e6,
        description="Relative weight of this task when rollout draws a training prompt (of a task with train_size).",
    )

    @field_validator("data")
    @classmethod
    def _data_scheme(cls, value: str | None) -> str | None:
        return value if value is None or "://" not in value else _check_store_uri(value)

    @field_validator("reward")
    @classmethod
    def _reward_scheme(cls, value: str | None) -> str | None:
        if value is not None and "://" in value:
            _check_store_uri(tasks.reward_parts(value)[0])
        return value

    @field_validator("prompt_template", mode="before")
    @classmethod
    def _template_text(cls, value):
        if isinstance(value, dict):  # YAML's reading of an unquoted {prompt} ..., or of Q: {prompt}
            raise ValueError(
                f"a mapping, {value!r}: quote the template ('{tasks.PROMPT_SLOT} ...'), which YAML reads "
                "as a mapping where it opens with a brace or holds ': '"
            )
        if isinstance(value, str) and (control := sorted({c for c in value if c < " " and c not in "\n\t"})):
            raise ValueError(
                f"holds the control character {control[0]!r} (in YAML's double quotes \\b is a backspace: write "
                "\\\\boxed, or quote the template with single quotes)"
            )
        if isinstance(value, str) and (escaped := _ESCAPED_COMMAND.search(value)):
            character, rest = escaped[0][0], escaped[0][1:]
            name, escape = {"\t": ("tab", "\\t"), "\n": ("newline", "\\n")}[character]
            raise ValueError(
                f"holds a {name} before {rest!r} (in YAML's double quotes {escape} is a {name}: write "
                f"\\{escape}{rest}, or quote the template with single quotes)"
            )
        return value

    @model_validator(mode="after")
    def _generated_or_read(self) -> "TaskConfig":
        if self.data is None:
            if self.name not in tasks.TASKS:
                raise ValueError(
                    f"name: {self.name!r} is no generated task family ({', '.join(tasks.TASKS)}); to read problems "
                    "from a file, set data"
                )
            if self.sha256 is not None:
                raise ValueError("sha256: is the digest of data's file; this task has no data")
            for field in FILE_SETTINGS:
                if getattr(self, field) != TaskConfig.model_fields[field].default:
                    does = (
                        "scores data's problems (a family scores its own)"
                        if field == "reward"
                        else "reads data's lines"
                    )
                    raise ValueError(f"{field}: {does}; this task has no data")
        elif self.name in tasks.TASKS:
            raise ValueError(
                f"name: {self.name!r} is a generated family's; name the file's problems otherwise (their reward is "
                "another)"
            )
        elif self.name in RESERVED_TASK_NAMES:
            raise ValueError(
                f"name: {self.name!r} names all the tasks at once (the training mix's metrics, the report's "
                "averages); name the file's problems otherwise"
            )
        elif self.answer_key == self.prompt_key:
            raise ValueError(f"answer_key: {self.answer_key!r} is prompt_key too; a line's answer is not its prompt")
        elif self.difficulty != 1:
            raise ValueError(f"difficulty: {self.difficulty} is a generated family's knob; a file's problems have none")
        if self.reward is None:
            if self.reward_sha256 is not None:
                raise ValueError("reward_sha256: is the digest of reward's file; this task has no reward of its own")
            if self.reward_timeout_s != TaskConfig.model_fields["reward_timeout_s"].default:
                raise ValueError("reward_timeout_s: limits reward's function; this task has no reward of its own")
        if self.prompt_template.count(tasks.PROMPT_SLOT) != 1:
            raise ValueError(
                f"prompt_template: {self.prompt_template!r} must hold {tasks.PROMPT_SLOT} once, where the prompt goes"
            )
        if self.train_size == self.test_size == 0:
            raise ValueError("train_size: 0 and test_size 0: the task is neither trained nor evaluated on")
        if self.train_size == 0 and self.weight != 1.0:
            raise ValueError(f"weight: {self.weight}, but the task has no training prompts (train_size 0) to draw")
        return self

    def unused_fields(self) -> set[str]:
        """The fields that do not apply to this task, which validation holds at their defaults: a generated
        family's file settings, a file's difficulty, a reward digest without a reward, the weight of a task
        never trained on. A config printed without them reads the same, and each task as what it is."""
        unused = {"data", "sha256", *FILE_SETTINGS} if self.data is None else {"difficulty"}
        unused |= {"reward_sha256", "reward_timeout_s"} if self.reward is None else set()
        return unused | ({"weight"} if self.train_size == 0 else set())


class ExtraProblems(_Section):
    """Problems bootstrap SFT trains on besides the tasks' training splits, never one of their prompts: more
    distinct problems than a task's difficulty holds (countdown's generator reaches about 2,750 at difficulty
    1), so that the base learns the task rather than memorizing its training split. RL and evaluation never
    see them."""

    name: TaskName = Field(description="Task family.")
    difficulty: int = Field(default=1, ge=1, le=5, description="Difficulty level, 1 (easiest) to 5.")
    size: int = Field(ge=1, le=1_000_000, description="Problems generated. Bounded: held in memory at once.")


class BootstrapConfig(_Section):
    """Supervised fine-tuning of the initial policy on the tasks before RL, so that
    RL starts from partial accuracy (components/bootstrap.py)."""

    enabled: bool = Field(default=False, description="Run bootstrap SFT in the prepare step.")
    steps: int = Field(default=300, ge=1, le=1_000_000, description="SFT optimizer steps.")
    batch_size: int = Field(
        default=32, ge=1, le=65536, description="Examples per SFT step. Bounded: held in memory at once."
    )
    learning_rate: float = Field(default=1e-3, gt=0.0, le=1.0, description="AdamW peak learning rate (warmup, cosine).")
    warmup: int = Field(default=30, ge=0, le=1_000_000, description="Linear warmup steps.")
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0, description="AdamW weight decay of SFT.")
    extra_problems: list[ExtraProblems] = Field(
        default_factory=list,
        description="Training-only problems mixed into SFT besides the tasks' training splits (none of the tasks' "
        "prompts).",
    )
    target_accuracy: float | None = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="Stop early once greedy accuracy on the check problems (eval_prompts) reaches it.",
    )
    eval_every: int = Field(default=50, ge=0, le=1_000_000, description="Steps between accuracy checks (0: none).")
    eval_prompts: int = Field(
        default=16,
        ge=1,
        le=65536,
        description="Problems of each accuracy check: held out of SFT from the tasks' training splits (each task "
        "with one in turn), never test problems.",
    )

    @model_validator(mode="after")
    def _warmup_ends(self) -> "BootstrapConfig":
        if self.enabled and self.warmup >= self.steps:
            raise ValueError(
                f"warmup {self.warmup} must be fewer than steps {self.steps}: the learning rate would never reach "
                "its peak nor decay"
            )
        return self

    @model_validator(mode="after")
    def _target_is_checked(self) -> "BootstrapConfig":
        if self.target_accuracy is not None and not 0 < self.eval_every < self.steps:
            raise ValueError(
                f"target_accuracy {self.target_accuracy} is checked every eval_every steps before the last: "
                f"eval_every must lie in 1..{self.steps - 1} (steps {self.steps}), got {self.eval_every}"
            )
        return self


class EvaluationConfig(_Section):
    """Evaluation after the last round: pass@1 and mean@k on held-out prompts under several rollout configs."""

    rollout_configs: list[RolloutConfigName] = Field(
        default_factory=lambda: ["bf16", "fp4_wa_kv"],
        min_length=1,
        description="Rollout configs the policy is evaluated under (each in rollout.fmt).",
    )
    samples_per_prompt: int = Field(default=4, ge=1, le=1024, description="k of mean@k: samples per test prompt.")
    test_prompts: int = Field(
        default=32,
        ge=0,
        le=1_000_000,
        description="Test prompts per evaluation, as many of each task with a test split (so rounded up to a "
        "multiple of their number); 0: every such task's whole test split (test_size), a benchmark whole.",
    )
    ptq_baselines: list[PTQMethod] = Field(
        default_factory=lambda: ["nvfp4", "four_over_six", "h_scale"],
        description="PTQ baselines applied to the final policy of a bf16 run, evaluated under its FP4 rollout configs.",
    )
    discrepancy_prompts: int = Field(
        default=8,
        ge=0,
        le=65536,
        description="Test prompts (x samples_per_prompt) of the train-rollout discrepancy analysis, each task "
        "in turn, at most the test prompts evaluation scores (evaluation.test_prompts); 0: none.",
    )
    initial: bool = Field(
        default=True,
        description="Evaluate the policy the run started from too (the report's RL gain). In a chain of runs "
        "(rl.rounds_per_run) the runs after the first leave it out: it is the trained policy the run before "
        "evaluated.",
    )

    @field_validator("rollout_configs", "ptq_baselines")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("entries must be distinct")
        return value


class StoreConfig(_Section):
    """The artifact store for guidance shards and checkpoints.

    S3 credentials come only from the environment (TRACEFP4_S3_ACCESS_KEY,
    TRACEFP4_S3_SECRET_KEY; in the cluster from `secret_name`): they are never
    read from a config file, dumped, shown or part of the JSON Schema. The
    other S3 settings here reach every pod of a cluster run; a run outside the
    cluster reads them from its own environment (docs/deploy.md, step 3).
    Whether the client speaks TLS is the endpoint's scheme."""

    uri: str = Field(
        default="file://./store",
        description="Store root: file:///absolute/path, file://./relative/path (from the run's output folder in a "
        "local run), s3://bucket/prefix or minio://bucket/prefix.",
        json_schema_extra={"pattern": STORE_URI_PATTERN},
    )
    endpoint: str | None = Field(
        default=None,
        pattern=HTTP_ENDPOINT,
        description=f"S3 endpoint the pipeline's pods use (http(s)://host:port), set as {ENDPOINT_ENV}; "
        "none: the pods' own environment.",
    )
    create_bucket: bool = Field(
        default=False,
        description="Create the S3 bucket of `uri` if it does not exist. Off, a missing bucket is an error, so that "
        "a typo in its name does not send the run's artifacts to a new bucket.",
    )
    secret_name: str = Field(
        default="tracefp4-store",
        pattern=DNS_SUBDOMAIN,
        description="Kubernetes secret holding the S3 credentials, mounted as the TRACEFP4_S3_* variables.",
    )
    region: str | None = Field(
        default=None,
        pattern=S3_REGION,
        description=f"S3 region the pipeline's pods sign requests for, set as {REGION_ENV}; none: the pods' own "
        "environment, else the bucket's, asked of the server.",
    )
    ca_bundle_secret: str | None = Field(
        default=None,
        pattern=DNS_LABEL,
        description=f"Kubernetes secret holding, under the key {CA_BUNDLE_KEY}, the PEM CA bundle the pipeline's "
        f"pods trust for https (an S3 server whose certificate a private CA signed, or a self-signed one): mounted "
        f"read-only at {CA_BUNDLE_MOUNT} in every step and TrainJob rank, and named by {CA_BUNDLE_ENV}. The pods "
        "then trust that bundle instead of the image's CA certificates, for the store and the Pushgateway alike: "
        "put every CA they need in it. A DNS label (no '.', at most 63 characters): KFP names the step pods' "
        "volume after the secret, and a volume's name is a label. None: the image's.",
    )
    access_key: SkipJsonSchema[SecretStr | None] = Field(
        default=None, exclude=True, repr=False, description="From TRACEFP4_S3_ACCESS_KEY only."
    )
    secret_key: SkipJsonSchema[SecretStr | None] = Field(
        default=None, exclude=True, repr=False, description="From TRACEFP4_S3_SECRET_KEY only."
    )

    @field_validator("uri")
    @classmethod
    def _uri(cls, value: str) -> str:
        return _check_store_uri(value)

    def pod_environment(self) -> dict[str, str]:
        """The variables every pod of a cluster run gets, by name, besides the credentials from
        `secret_name`: the endpoint, the region and the mounted CA bundle, those set."""
        env = {ENDPOINT_ENV: self.endpoint, REGION_ENV: self.region}
        if self.ca_bundle_secret:
            env[CA_BUNDLE_ENV] = f"{CA_BUNDLE_MOUNT}/{CA_BUNDLE_KEY}"
        return {name: value for name, value in env.items() if value}

    @field_validator("access_key", "secret_key", mode="before")
    @classmethod
    def _env_only(cls, value: object, info: ValidationInfo) -> object:
        if value is not None and (info.context or {}).get("from_file"):
            raise ValueError(f"set only from the environment variable {SECRET_ENV[info.field_name]}")
        return value


class MetricsConfig(_Section):
    """Where run metrics go: a Prometheus text file, and a Pushgateway when given."""

    pushgateway_url: str | None = Field(
        default=None, pattern=HTTP_URL, description="Pushgateway base URL (http(s)://host:port), or none."
    )
    metrics_file: str = Field(
        default="metrics.prom", min_length=1, pattern=r"^\S+$", description="Prometheus text-format file written."
    )
    job: str = Field(
        default="tracefp4", pattern=r"^[A-Za-z0-9_.:-]{1,128}$", description="Prometheus `job` label of pushed metrics."
    )


class Toleration(_Section):
    """A Kubernetes pod toleration."""

    key: str | None = Field(
        default=None, pattern=LABEL_KEY, max_length=317, description="Taint key; none (operator Exists) matches all."
    )
    operator: Literal["Equal", "Exists"] = Field(default="Equal", description="Equal matches value; Exists any value.")
    value: str | None = Field(default=None, pattern=LABEL_VALUE, description="Taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect matched; none matches all."
    )

    @model_validator(mode="after")
    def _exists_has_no_value(self) -> "Toleration":
        if self.operator == "Exists" and self.value is not None:
            raise ValueError("operator Exists takes no value")
        if self.key is None and self.operator != "Exists":  # as Kubernetes refuses the pod
            raise ValueError("a toleration without a key matches every taint: it needs operator Exists")
        return self


class ResourcesConfig(_Section):
    """Cluster resources of each pipeline step (ignored by local runs), and the device every step computes on."""

    device: str = Field(
        default="auto",
        pattern=DEVICE_PATTERN,
        description="Device of every step (policy, rollout engine, KV cache, capture, trainer): auto (CUDA when torch "
        "sees a GPU, else CPU), cpu, cuda or cuda:N. A CUDA device the step's machine lacks fails the step at its "
        "start.",
    )
    cpu: str = Field(default="2", pattern=K8S_CPU, description="CPU request/limit (Kubernetes quantity: '2', '500m').")
    memory: str = Field(default="8Gi", pattern=K8S_MEMORY, description="Memory request/limit ('8Gi', '512Mi').")
    host_cpu: str | None = Field(
        default=None,
        pattern=K8S_CPU,
        description="CPU of the steps that only move a round's data (gather; train when its ranks run in a "
        "TrainJob, which streams checkpoints through the store): they compute nothing on the device. None: cpu.",
    )
    host_memory: str | None = Field(
        default=None,
        pattern=K8S_MEMORY,
        description="Memory of those steps (gather holds a round's trajectories). None: memory.",
    )
    gpus: int = Field(
        default=0,
        ge=0,
        le=64,
        description="Accelerators of a training node: the train step's pod when its torchrun runs several "
        "processes there, or each TrainJob node. Every other step computes on one device and requests one.",
    )
    accelerator_type: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_./]{0,251}[A-Za-z0-9])?$",
        description="Accelerator resource to request, e.g. 'nvidia.com/gpu' (the limit's name, as KFP and the "
        "TrainJob set it); required when gpus > 0.",
    )
    node_selector: dict[LabelKey, LabelValue] = Field(
        default_factory=dict, description="Node labels a step must run on."
    )
    tolerations: list[Toleration] = Field(default_factory=list, description="Taints a step tolerates.")
    labels: dict[LabelKey, LabelValue] = Field(
        default_factory=dict,
        description="Labels of every step's pod and of each TrainJob, e.g. kueue.x-k8s.io/queue-name: <a "
        "LocalQueue>, by which Kueue admits the steps and the TrainJobs into the team's quota (docs/deploy.md).",
    )

    @model_validator(mode="after")
    def _gpus_need_a_type(self) -> "ResourcesConfig":
        if self.gpus > 0 and self.accelerator_type is None:
            raise ValueError("gpus > 0 needs accelerator_type")
        return self


class RunConfig(_Section):
    """A whole tracefp4 run: policy, rollout, guidance, RL, tasks, evaluation and where it runs."""

    name: str = Field(default="tracefp4", pattern=DNS_LABEL, description="Run name (DNS label: a-z, 0-9, '-').")
    seed: int = Field(
        default=0,
        ge=0,
        le=2**53,  # KFP carries integer parameters as JSON doubles: a larger seed would run as another
        description="Seed of model init, task generation and sampling; at most 2**53, the largest integer a "
        "pipeline parameter holds exactly.",
    )
    model: ModelConfig = Field(default_factory=lambda: ModelConfig(preset="tiny"), description="The policy.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Rollout engine and sampling.")
    guidance: GuidanceConfig = Field(default_factory=GuidanceConfig, description="Rollout guidance kept for training.")
    rl: RLConfig = Field(default_factory=RLConfig, description="RL loop and optimizer.")
    method: Method = Field(
        default="trace",
        description="Training method: bf16 (no QAT), qat (RTN), quads (weights-only QAT + rollout compensation), "
        "trace (rollout-guided rounding), tis_sc (TIS + score centering). docs/training.md.",
    )
    train: TrainSection = Field(
        default_factory=TrainSection, description="The trainer's numerics, and the processes and machines it runs on."
    )
    bootstrap: BootstrapConfig = Field(default_factory=BootstrapConfig, description="SFT of the initial policy.")
    tasks: list[TaskConfig] = Field(
        default_factory=lambda: [TaskConfig(name="arithmetic")], min_length=1, description="Training task mix."
    )
    evaluation: EvaluationConfig = Field(
        default_factory=EvaluationConfig, description="Evaluation after the last round."
    )
    store: StoreConfig = Field(default_factory=StoreConfig, description="Artifact store.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Metrics output.")
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig, description="Per-step cluster resources.")
    image: str = Field(
        default="ghcr.io/tracefp4/tracefp4:0.1.0-cpu",
        pattern=IMAGE,
        max_length=512,
        description="Container image of the pipeline components.",
    )
    kfp_host: str = Field(
        default="http://ml-pipeline.kubeflow:8888",
        pattern=HTTP_URL,
        max_length=512,
        description="The Kubeflow Pipelines API as the run's pods reach it: where the last task of a run that "
        "leaves rounds to the next (rl.rounds_per_run) submits it.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> "RunConfig":
        problems = []
        if self.rollout.max_new_tokens >= self.model.max_seq_len:
            problems.append(
                f"rollout.max_new_tokens: must be less than model.max_seq_len ({self.model.max_seq_len}) "
                "to leave room for the prompt"
            )
        if self.method == "trace" and self.rollout.config == "bf16":
            problems.append("method: trace guides training with FP4 rollout codes; rollout.config bf16 records none")
        microbatches = -(-self.rollout.prompts_per_step * self.rollout.group_size // self.rl.microbatch_size)
        per_step = -(-microbatches // (self.rl.grad_accumulation or microbatches))  # optimizer steps an RL step
        if self.rl.kl_coef > 0 and self.rl.steps_per_round * per_step == 1:
            problems.append(
                f"rl.kl_coef: {self.rl.kl_coef} penalizes the KL to the policy the round started from, which a "
                "round of one optimizer step trains: the penalty and its gradient are 0; use off_policy with "
                "rl.steps_per_round > 1, or rl.grad_accumulation below the microbatches of an RL step"
            )

        if self.rl.schedule == "on_policy" and (self.rl.steps_per_round != 1 or self.rl.grad_accumulation != 0):
            problems.append(
                "rl.schedule: on_policy trains each rollout batch with one optimizer step; it needs "
                f"rl.steps_per_round 1 (got {self.rl.steps_per_round}) and rl.grad_accumulation 0 "
                f"(got {self.rl.grad_accumulation}); use off_policy for more"
            )
        names = [t.name for t in self.tasks]
        problems += [
            f"tasks.{i}.name: {name} is listed twice; evaluation and the splits keep tasks apart by name "
            "(two difficulties of one task would share its test prompts and leak training ones)"
            for i, name in enumerate(names)
            if name in names[:i]
        ]
        for split, use in (("train_size", "train"), ("test_size", "evaluate")):
            if all(getattr(t, split) == 0 for t in self.tasks):
                problems.append(f"tasks: every task's {split} is 0: nothing to {use} on")
        tested = sum(t.test_size > 0 for t in self.tasks)
        problems += [
            f"tasks.{i}.test_size: {t.test_size} held-out {t.name} prompts, but evaluation.test_prompts "
            f"{self.evaluation.test_prompts} asks {share} of each of the {tested} tasks with a test split (0: "
            "each one's whole test split)"
            for i, (t, share) in enumerate(zip(self.tasks, self.test_shares))
            if t.test_size < share
        ]
        problems += [
            f"tasks.{i}.train_size: {t.train_size} {t.name} problems, of which bootstrap SFT holds out {k} to check "
            f"its accuracy on (bootstrap.eval_prompts {self.bootstrap.eval_prompts}): none left to train on"
            for i, (t, k) in enumerate(zip(self.tasks, self.bootstrap_checks))
            if 0 < t.train_size <= k
        ]
        problems += self._train_problems()
        problems += self._continuation_problems()
        device, _, index = self.resources.device.partition(":")
        if self.resources.gpus and device == "cuda" and index and int(index) > 0:
            problems.append(
                f"resources.device: {self.resources.device}, but a step's pod is given one GPU, which it sees as "
                "cuda:0: use cuda or auto"
            )
        per_step = self.rollout.prompts_per_step * self.rollout.group_size
        if self.rollout.workers > per_step:
            problems.append(
                f"rollout.workers: {self.rollout.workers} workers, but an RL step rolls out only {per_step} "
                "responses (rollout.prompts_per_step x group_size): a worker would have none"
            )
        mxfp4_most = (MAX_CODE_BITS + scale_bits_cap(8)) / BLOCK_ELEMENTS
        if (
            self.guidance.codec == "syndrome"
            and self.rollout.fmt == "mxfp4"
            and self.guidance.syndrome_rate > mxfp4_most
        ):
            problems.append(
                f"guidance.syndrome_rate: {self.guidance.syndrome_rate} bits per element, but an MXFP4 block of "
                f"{BLOCK_ELEMENTS} elements (8 scales) takes at most {mxfp4_most}"
            )
        if self.guidance.codec == "syndrome" and self.guidance.bits != 1:
            problems.append(
                f"guidance.codec: syndrome sends R-1 guidance (the low code bit), so guidance.bits must be 1, "
                f"got {self.guidance.bits}"
            )
        problems += self._activation_scale_problems()
        problems += self._fp4_problems()
        if self.rl.measure_mismatch and self.guidance.compaction != "offline":
            problems.append("rl.measure_mismatch: needs the rollout's full capture, so guidance.compaction offline")
        if self.model.preset is not None:  # a checkpoint's layers are checked when prepare reads its config
            problems += self.guided_layer_problems(
                architecture.PRESETS[self.model.preset], f"model preset {self.model.preset}"
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _continuation_problems(self) -> list[str]:
        """A continuation names the policy and trainer state the run it
        continues ended with, and the round it goes on from; it has no bootstrap."""
        if not self.model.trainer_state:
            if self.rl.first_round:
                return [
                    f"rl.first_round: {self.rl.first_round} continues a run: set model.checkpoint and "
                    "model.trainer_state to the new_policy and new_trainer_state its last train task saved"
                ]
            return []
        problems = []
        if self.model.checkpoint is None:
            problems.append(
                "model.trainer_state: a continuation goes on from the policy saved with that state: set "
                "model.checkpoint to the same train task's new_policy"
            )
        if not self.rl.first_round:
            problems.append(
                "model.trainer_state: a continuation goes on after the rounds the state was trained in: compile "
                "it with rl.first_round set to their number"
            )
        if self.bootstrap.enabled:
            problems.append(
                "bootstrap.enabled: a continuation (model.trainer_state) goes on from a trained policy; the "
                "bootstrap SFT comes before a run's first round"
            )
        return problems

    def _fp4_problems(self) -> list[str]:
        """What needs FP4 sites the rollout lacks, and a capture buffer that
        cannot hold one prompt: each would run and then fail, or do nothing."""
        problems, fmt = [], self.rollout.fmt
        rollout = quant_config.rollout_config(self.rollout.config, fmt)
        if self.method in ("qat", "tis_sc") and self.rollout.config == "bf16":
            problems.append(
                f"method: {self.method} trains against an FP4 rollout; rollout.config bf16 has none (the run would "
                "train as method bf16 does)"
            )
        if self.method == "quads" and rollout.weights is None:
            problems.append(
                f"method: quads fake-quantizes the routed experts' FP4 weights; rollout.config {self.rollout.config} "
                "keeps them BF16"
            )
        if self.rl.measure_mismatch and self.rollout.config == "bf16":
            problems.append("rl.measure_mismatch: compares FP4 codes; rollout.config bf16 records none")
        elif self.rl.measure_mismatch and self.method not in choices.QUANTIZING_CAPTURED_SITES:
            problems.append(
                f"rl.measure_mismatch: compares the training path's FP4 codes with the rollout's; method "
                f"{self.method} quantizes none of the sites a rollout captures in training (methods "
                f"{', '.join(choices.QUANTIZING_CAPTURED_SITES)} do)"
            )
        longest = self.model.max_seq_len - self.rollout.max_new_tokens  # the longest prompt a run lets through
        if self.rollout.max_tokens_per_forward < longest:
            problems.append(
                f"rollout.max_tokens_per_forward: {self.rollout.max_tokens_per_forward} token rows, but a forward "
                f"takes a whole prompt, of up to {longest} tokens (model.max_seq_len - rollout.max_new_tokens)"
            )
        scoring = [
            n for n in self.evaluation.rollout_configs if choices.scored_under(quant_config.rollout_config(n, fmt))
        ]
        if self.method == "bf16" and self.evaluation.ptq_baselines and not scoring:
            problems.append(
                "evaluation.ptq_baselines: scored under the evaluation's configs with NVFP4 weights, and "
                f"evaluation.rollout_configs {self.evaluation.rollout_configs} in rollout.fmt {fmt} has none; "
                "set it to []"
            )
        return problems

    def _activation_scale_problems(self) -> list[str]:
        """Per-token global scales are NVFP4's, of FP4 activations, and the syndrome codec carries static ones only."""
        if self.rollout.activation_global_scale != "per_token":
            return []
        problems = []
        if self.rollout.fmt != "nvfp4":
            problems.append(
                f"rollout.activation_global_scale: per_token sets NVFP4 global scales; rollout.fmt {self.rollout.fmt} "
                "has none"
            )
        if self.rollout.config not in FP4_ACTIVATION_CONFIGS:
            problems.append(
                f"rollout.activation_global_scale: per_token applies to FP4 activations; rollout.config "
                f"{self.rollout.config} has none (configs with them: {', '.join(FP4_ACTIVATION_CONFIGS)})"
            )
        if self.guidance.codec == "syndrome":
            problems.append(
                "rollout.activation_global_scale: per_token needs guidance.codec bits (the syndrome codec carries "
                "one static global scale per layer and site)"
            )
        return problems

    @property
    def test_shares(self) -> list[int]:
        """How many of each task's test prompts evaluation scores: ``evaluation.test_prompts`` spread evenly
        over the tasks with a test split, rounded up; where it is 0, each one's whole test split."""
        tested = sum(t.test_size > 0 for t in self.tasks)
        share = -(-self.evaluation.test_prompts // max(tested, 1))
        return [0 if t.test_size == 0 else share or t.test_size for t in self.tasks]

    @property
    def bootstrap_checks(self) -> list[int]:
        """How many of each task's training problems bootstrap SFT holds out to check
        its accuracy on (``bootstrap.eval_prompts``, the tasks with training
        problems in turn; none without checks)."""
        b = self.bootstrap
        checks = b.eval_prompts if b.enabled and 0 < b.eval_every < b.steps else 0
        trained = [i for i, t in enumerate(self.tasks) if t.train_size > 0]
        turn = {i: j for j, i in enumerate(trained)}
        n = max(len(trained), 1)
        return [checks // n + (turn[i] < checks % n) if i in turn else 0 for i in range(len(self.tasks))]

    @property
    def train_precision(self) -> str:
        """``train.precision``, or where unset the rollout's numerics (:class:`TrainSection`)."""
        if self.train.precision is not None:
            return self.train.precision
        if self.train.world_size > 1 or self.model.dtype == "float32":
            return "fp32_master"
        return "bf16"

    def without_cluster_only(self) -> "RunConfig":
        """This config with every :data:`CLUSTER_ONLY` field at its default: what
        a local run's steps are given and what its resumption compares
        (:func:`tracefp4.pipelines.resume.request`). A step's cache key and the run id
        hold the whole config the steps get, so the image or a pod's memory,
        which change no step's output here, would otherwise rerun every task."""
        return _at_defaults(self, CLUSTER_ONLY)

    def _train_problems(self) -> list[str]:
        """Distributed training: one node unless a TrainJob launches it, and every
        optimizer step's microbatches split evenly over the processes."""
        t, problems = self.train, []
        if t.nodes > 1 and t.launcher != "trainjob":
            problems.append(f"train.nodes: {t.nodes} machines need train.launcher trainjob (torchrun runs on one)")
        world = t.world_size
        if world > 1 and self.train_precision != "fp32_master":
            problems.append(
                f"train.precision: {world} training processes need fp32_master (FSDP2 shards the float32 "
                f"parameters themselves), got {t.precision}"
            )
        r = self.resources
        if world > 1 and r.gpus and r.device != "cpu" and t.processes_per_node > r.gpus:
            problems.append(
                f"train.processes_per_node: {t.processes_per_node} processes per node, each on a GPU of its own "
                f"(cuda:LOCAL_RANK), but resources.gpus gives a node {r.gpus}"
            )
        per_step = -(-self.rollout.prompts_per_step * self.rollout.group_size // self.rl.microbatch_size)
        problem = uneven_split(per_step, self.rl.grad_accumulation or per_step, world)
        if problem is not None:
            problems.append(
                f"rl.grad_accumulation: {problem} (microbatches: rollout.prompts_per_step x rollout.group_size / "
                "rl.microbatch_size, rounded up; an optimizer step every rl.grad_accumulation of them, 0: one a "
                "step; training processes: train.nodes x train.processes_per_node)"
            )
        return problems

    def guided_layer_problems(self, cfg: architecture.ModelConfig, model_name: str) -> list[str]:
        """``guidance.layers`` against the layers of ``cfg`` (``model_name`` in the
        message) that have FP4 sites under the run's rollout config and, for trace,
        whose discrepancy analysis guides the same layers, under each FP4 config
        evaluation rolls out with (a hybrid model's linear-attention layers hold
        no KV cache, a dense layer no expert activations)."""
        layers = self.guidance.layers
        if isinstance(layers, list) and max(layers) >= cfg.num_layers:
            return [f"guidance.layers: layer {max(layers)} does not exist; {model_name} has {cfg.num_layers}"]
        names = [self.rollout.config]
        if self.method == "trace" and self.evaluation.discrepancy_prompts:
            names += [name for name in self.evaluation.rollout_configs if name not in names]
        problems = []
        for name in names:
            fp4 = quant_config.rollout_config(name, self.rollout.fmt).fp4_layers(cfg)
            where = f"{model_name} has FP4 sites in layers {fp4} under rollout config {name}"
            if not fp4:  # bf16: nothing captured to guide (trace with a bf16 rollout is refused on its own)
                continue
            if isinstance(layers, int) and layers > len(fp4):
                problems.append(f"guidance.layers: the deepest {layers} layers with FP4 sites; {where}")
            if isinstance(layers, list) and (missing := sorted(set(layers) - set(fp4))):
                problems.append(f"guidance.layers: layers {missing} have no FP4 site; {where}")
        return problems


def _at_defaults(section: BaseModel, paths) -> BaseModel:
    """``section`` with the fields at the dotted ``paths`` (below it) at their defaults."""
    leaves, below = {}, {}
    for path in paths:
        name, _, rest = path.partition(".")
        if rest:
            below.setdefault(name, []).append(rest)
        else:
            leaves[name] = type(section).model_fields[name].get_default(call_default_factory=True)
    nested = {name: _at_defaults(getattr(section, name), rests) for name, rests in below.items()}
    return section.model_copy(update={**leaves, **nested})
