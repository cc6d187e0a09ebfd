"""Assembling a worker: the model on its device, the KV pools sized from memory, the KV
manager, and the engine (the runner its model needs, the scheduler's limits, the output
processor), then one warm-up request through it all before the worker says it is ready.

Which runner a model gets is an explicit table keyed by the spec's `engine` kind; nothing
is picked by probing the model.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import msgspec
import torch

from services.gpu_worker.engine import Engine
from services.gpu_worker.flashinfer_backend import FlashInferPlanner, flashinfer_available
from services.gpu_worker.guided import Guides
from services.gpu_worker.kv_manager import KVManager
from services.gpu_worker.kv_memory import kv_cache, release_pools, size_pool, state_cache
from services.gpu_worker.modeling.base import ModelBase
from services.gpu_worker.outputs import OutputProcessor
from services.gpu_worker.runners.bagel import BagelRunner
from services.gpu_worker.runners.bagel_image import BagelImageRunner
from services.gpu_worker.runners.base import ModelRunner
from services.gpu_worker.runners.chatterbox import ChatterboxRunner
from services.gpu_worker.runners.csm import CsmRunner
from services.gpu_worker.runners.diffusion import DiffusionRunner
from services.gpu_worker.runners.encdec import MAX_ENCODES_PER_STEP, EncoderDecoderRunner
from services.gpu_worker.runners.higgs import HiggsRunner
from services.gpu_worker.runners.hybrid import HybridRunner
from services.gpu_worker.runners.hybrid_vision import HybridVisionRunner
from services.gpu_worker.runners.mrope import MropeVisionRunner
from services.gpu_worker.runners.omni import OmniRunner
from services.gpu_worker.runners.omni_speech import OmniSpeechRunner
from services.gpu_worker.runners.policy import PolicyRunner
from services.gpu_worker.runners.pooling import PoolingRunner
from services.gpu_worker.runners.qwen3_tts import Qwen3TTSRunner
from services.gpu_worker.runners.speech import SpeechRunner
from services.gpu_worker.runners.vision import MAX_ENCODES_PER_STEP as VISION_ENCODES_PER_STEP
from services.gpu_worker.runners.vision import VisionRunner
from services.gpu_worker.runners.world import WorldRunner
from services.gpu_worker.scheduler import Limits, Scheduler
from services.gpu_worker.step_costs import calibrate_cached, calibration_groups
from services.gpu_worker.stop_check import StopChecks
from services.gpu_worker.tp.group import TpGroup
from services.gpu_worker.tp.runner import TpRunner
from services.gpu_worker.weights import build_model, prompt_path, weight_dtype
from shared.config import Deployment, kv_dtype
from shared.frames import NewRequest, SamplingParams, pack_tensors
from shared.model_source import ModelSource
from shared.pages import pages_for
from shared.specs.base import DeploymentError, ModelSpec, describe_parameters, refuse_runner_gaps

log = logging.getLogger("mstar.build")

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}

#: the spec's `engine` kind -> its runner, and the most admissions one step may do
RUNNERS: dict[str, tuple[type[ModelRunner], int | None]] = {
    "decoder": (ModelRunner, None),
    "hybrid_decoder": (HybridRunner, None),
    "encoder_decoder": (EncoderDecoderRunner, MAX_ENCODES_PER_STEP),
    "pooling": (PoolingRunner, None),
    "vision_decoder": (VisionRunner, VISION_ENCODES_PER_STEP),
    "speech_decoder": (SpeechRunner, None),
    "mrope_vision_decoder": (MropeVisionRunner, VISION_ENCODES_PER_STEP),
    "hybrid_mrope_vision_decoder": (HybridVisionRunner, VISION_ENCODES_PER_STEP),
    "csm_decoder": (CsmRunner, None),
    "policy": (PolicyRunner, None),
    "world": (WorldRunner, None),
    "diffusion": (DiffusionRunner, None),
    "omni_thinker": (OmniRunner, VISION_ENCODES_PER_STEP),
    "higgs_decoder": (HiggsRunner, None),
    "chatterbox_decoder": (ChatterboxRunner, None),
    "bagel_decoder": (BagelRunner, VISION_ENCODES_PER_STEP),
    "bagel_diffusion": (BagelImageRunner, None),
    "qwen3_tts": (Qwen3TTSRunner, None),
}


#: engines whose steps are a decoder LM's over token rows (a vision model's images are
#: rows of its prompt): FlashInfer plans them, the step-cost model times them
TEXT_STEPS = ("decoder", "hybrid_decoder", "vision_decoder", "mrope_vision_decoder", "hybrid_mrope_vision_decoder",
              "speech_decoder", "omni_thinker", "bagel_decoder")


@dataclass(frozen=True)
class Speculation:
    """Prompt-lookup speculative decoding: drafts per step (0: off) and the n-gram sizes."""

    k: int = 0
    ngram_max: int = 3
    ngram_min: int = 2


def build_engine(model, spec, kv: KVManager, caches: dict[str, list[torch.Tensor]], *, eos_ids: list[int],
                 max_num_seqs: int, max_batch_tokens: int, max_seq_len: int, planner=None,
                 speculation: Speculation = Speculation(), itl_target_s: float = 0.0,
                 guides: Guides | None = None, group: TpGroup | None = None,
                 stops: StopChecks | None = None) -> Engine:
    runner_cls, max_admissions = RUNNERS[spec.engine]
    if spec.engine == "omni_thinker" and getattr(spec, "speaks", False):
        runner_cls = OmniSpeechRunner  # the thinker's runner, and its talker stage
    refuse_runner_gaps(spec, runner_cls.SPEC)
    runner = (TpRunner(model, spec, kv, caches, planner, group=group) if group is not None
              else runner_cls(model, spec, kv, caches, planner))
    k = speculation.k
    # A windowed label releases pages behind its window as rows commit; draft rows past
    # the commit could straddle one page more than its footprint, so no drafts there.
    if k and (spec.engine != "decoder" or any(lab.window is not None for lab in spec.kv_labels)):
        why = ("its recurrent state cannot take back a rejected draft" if spec.engine.startswith("hybrid")
               else "the model has a sliding-window KV label or is not a decoder LM")
        log.warning("speculative decoding is off: %s", why)
        k = 0
    if spec.whole_prompts and max_batch_tokens < max_seq_len:
        # a prompt runs in one step: the budget must hold the longest, or it would wait forever
        log.warning("max_batch_tokens %d raised to the model's max length %d: its prompts run whole",
                    max_batch_tokens, max_seq_len)
        max_batch_tokens = max_seq_len
    limits = Limits(max_num_seqs, max_batch_tokens, max_seq_len, max_admissions, itl_target_s,
                    max_logit_rows(spec.vocab_size))
    scheduler = Scheduler(kv, limits, spec.step_loops, k, spec.whole_prompts)
    outputs = OutputProcessor(spec.step_loops, eos_ids, max_seq_len)
    ngram = (speculation.ngram_max, speculation.ngram_min) if k else None
    return Engine(kv, scheduler, runner, outputs, ngram, guides, stops)


#: the float32 logits a step may hold for prompt logprobs (their log-softmax and the
#: copies beside it take about 3x this): docs/reliability.md
LOGIT_BYTES = 64 << 20
#: ...but never fewer rows than this a step (a huge vocabulary would crawl otherwise)
MIN_LOGIT_ROWS = 32


def max_logit_rows(vocab_size: int) -> int:
    """Prompt rows a step puts through the LM head for prompt logprobs (0: no cap known)."""
    return max(MIN_LOGIT_ROWS, LOGIT_BYTES // (4 * vocab_size)) if vocab_size else 0


@dataclass
class Assembled:
    """Everything a worker process serves with."""

    source: ModelSource
    spec: ModelSpec
    pools: dict
    model: ModelBase
    kv: KVManager
    engine: Engine
    #: the tensor-parallel group this rank belongs to (None: one process)
    group: TpGroup | None = None


def pick_device() -> torch.device:
    """MSTAR_DEVICE (cpu | cuda | cuda:N), else CUDA when there is one. On CUDA the
    decoder path attends through FlashInfer when it is importable, through torch if not."""
    want = os.environ.get("MSTAR_DEVICE", "auto")
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(want)


def assemble(d: Deployment, group: TpGroup | None = None) -> Assembled:
    """Load the model, size and allocate the pools, build and warm up the engine. A
    tensor-parallel rank (`group`) loads its shard and allocates its heads' share of the
    same pages; only rank 0 warms up (the others run its warm-up's forwards in lockstep)."""
    source = ModelSource(d.model)
    spec = source.spec(d.page_size, d.max_seq_len, kv_dtype(d), d.task)
    spec.validate()
    device = pick_device()
    if group is not None and spec.engine != "decoder":
        raise DeploymentError(f"--tensor-parallel-size {group.size}: tensor parallelism shards decoder LMs; this "
                              f"model's engine is {spec.engine!r}, which it does not split")
    if kv_dtype(d) == "int8" and device.type != "cpu":
        raise DeploymentError(f"kv_cache_dtype int8 is the CPU path's (its C kernels); the worker runs on {device}, "
                              "whose FlashInfer / torch path takes float pages: use --kv-cache-dtype auto or bfloat16")
    if spec.engine not in TEXT_STEPS and device.type != "cpu":
        log.warning("the %s engine runs on the CPU path only for now; ignoring device %s", spec.engine, device)
        device = torch.device("cpu")
    min_pages = pages_for(spec.max_seq_len, d.page_size)
    # a state pool: a slot per request that may run at once, as many again for prefix snapshots
    spec.with_state_slots(2 * d.max_num_seqs)
    num_pages = size_pool(d.num_kv_pages, d.kv_memory_fraction, spec.bytes_per_page(d.page_size), min_pages, device)
    if group is not None:  # every rank the same pages (each measured its own memory)
        num_pages = group.min_int(num_pages)
    pools = spec.paged_pools(num_pages)
    dtype, quantized = weight_dtype(d.dtype, source, device)
    t0 = time.time()
    model = build_model(source, spec, dtype, device, quantized) if group is None else _build_shard(
        source, spec, dtype, device, group)
    prompt_path(model, d.prefill_dtype)
    cache_dtype = TORCH_DTYPES[kv_dtype(d)]
    # a rank's pages hold its KV heads (the conductor counts the pages, the same on every rank)
    rank_kv = None if group is None else int(model.config.num_key_value_heads)  # type: ignore[union-attr,arg-type]
    caches = {name: state_cache(p.num_layers, p.num_pages, p.state_floats, device) if p.is_state
              else kv_cache(p.num_layers, p.num_pages, p.page_size, rank_kv or p.kv_heads, p.head_dim, cache_dtype,
                            device)
              for name, p in pools.items()}
    planner = None
    if device.type == "cuda" and spec.engine in TEXT_STEPS and flashinfer_available():
        planner = FlashInferPlanner(device)
    kv = KVManager(pools, spec.kv_labels, reserve_max_seq_len=d.admission == "max-seq-len", prefix_cache=d.prefix_cache)
    engine = build_engine(model, spec, kv, caches, eos_ids=[*source.eos_token_ids, *spec.stop_ids],
                          max_num_seqs=d.max_num_seqs,
                          max_batch_tokens=d.max_batch_tokens, max_seq_len=spec.max_seq_len, planner=planner,
                          speculation=Speculation(d.speculative_k, d.speculative_ngram_max, d.speculative_ngram_min),
                          itl_target_s=d.itl_target_ms / 1000,
                          guides=Guides(lambda: source.tokenizer.tokenizer.to_str(), spec.vocab_size,
                                        source.eos_token_ids), group=group,
                          stops=StopChecks(lambda: source.tokenizer.tokenizer))
    log.info("model loaded in %.1fs%s; pools %s", time.time() - t0, describe_parameters(spec),
             {n: f"{p.num_pages} pages x {p.page_size} rows" for n, p in pools.items()})
    parts = Assembled(source, spec, pools, model, kv, engine, group)
    if group is None or group.rank == 0:
        warm_up(parts, d)
    if group is None:  # every page is free again: the warm-up's resident memory goes back (issue 49)
        log.debug("KV pools: %.0f MB of warm-up pages given back", release_pools(caches) / 1e6)
    return parts


def _build_shard(source: ModelSource, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                 group: TpGroup) -> ModelBase:
    """A tensor-parallel rank's model (tp/load.py), its C GEMMs on the threads a one-rank
    worker's get."""
    from services.gpu_worker.layers import quant
    from services.gpu_worker.tp.load import build_shard

    model = build_shard(source, spec, dtype, device, group)
    if device.type == "cpu":
        quant.set_threads(quant.default_threads())
    return model


def warm_up(parts: Assembled, d: Deployment) -> None:
    """One real prefill + decode through the paged path, so the first request does not
    pay for lazy init; its pages go back, and it leaves no trace in the prefix cache or
    the pools' counters, before the worker says it is ready. A model whose declarations
    are wrong fails here, at start."""
    spec, kv, engine = parts.spec, parts.kv, parts.engine
    n = min(16, spec.max_seq_len - 2)
    # A speech model's warm-up takes a real request's path: no prompt ids, silent audio,
    # the default decoder prompt (Whisper's language probe, where it detects the language).
    ppo = spec.process_prompt(spec.warmup_request(n))
    n = int(ppo.metadata.get("prompt_len", n))
    caps = spec.clamp_caps(spec.get_loop_caps(2, prompt_len=n))
    refs, _ = pack_tensors(ppo.new_input_tensors)
    # A model whose layouts name labels it never declared fails here, at start, not on the
    # first request that reaches it.
    layout = ppo.kv_layout
    spec.refuse_undeclared_labels(layout)
    req = NewRequest("warmup", "", refs, SamplingParams(temperature=0.0), "", n, 2, layout, caps,
                     spec.kv_configs(layout, caps, parts.pools), metadata=ppo.metadata)
    with kv.untracked():
        engine.add(req, ppo.new_input_tensors)
        while engine.has_work:
            if engine.step().errors:
                raise RuntimeError("the warm-up request failed (see the error logged above); the model cannot serve")
    t0 = time.time()
    runs = parts.model.warm_gemms(d.max_batch_tokens, min(d.max_num_seqs, d.max_batch_tokens))
    if runs:
        log.info("built %d GEMM kernels for every row bucket in %.2fs", runs, time.time() - t0)
    if d.itl_target_ms > 0 and spec.engine in TEXT_STEPS:  # step costs for the time-budgeted scheduler
        t0 = time.time()
        with kv.untracked():
            costs, cached = calibrate_cached(engine, spec, parts.pools, d.max_batch_tokens, d.max_num_seqs,
                                             calibration_key_parts(parts, d))
        log.info("step costs %s in %.2fs: %s; prefill beside decode rows sized to %g ms steps",
                 "read from the cache" if cached else "learned", time.time() - t0, costs.describe(),
                 d.itl_target_ms)


def _device_name(model: torch.nn.Module) -> str:
    device = next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))
    return torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)


def calibration_key_parts(parts: Assembled, d: Deployment) -> dict | None:
    """What a step-cost calibration depends on, for its cache key: the model's files (path,
    size, mtime), the machine and kernel build, the gpu worker's code, the threads, the pools
    (where too small to hold every calibration prompt) and the deployment's limits; None
    when the model's files cannot be read."""
    from services.gpu_worker import tuning_cache
    from services.gpu_worker.layers import quant
    from shared.version import mstar_version

    try:
        model = tuning_cache.files_identity(parts.source.path)
    except (OSError, TypeError):
        return None
    spec = parts.spec
    # a pool's size matters only where it cannot hold every calibration prompt at once
    prompts = [shape for group in calibration_groups(spec, d.max_batch_tokens, d.max_num_seqs) for shape in group]
    pools = {}
    for name, p in parts.pools.items():
        enough = sum(pages_for(n + t + 1, p.page_size) for n, t in prompts) * max(1, len(spec.kv_labels))
        pools[name] = [min(p.num_pages, enough), p.page_size, p.num_layers, p.kv_heads, p.head_dim]
    limits = {k: v for k, v in msgspec.structs.asdict(d).items()
              if k not in ("model", "num_kv_pages", "kv_memory_fraction")}
    return {
        "model": model, "spec": [type(spec).__name__, spec.engine, spec.max_seq_len], "limits": limits,
        "pools": pools, "machine": tuning_cache.machine_identity(), "device": _device_name(parts.model),
        "threads": [torch.get_num_threads(), quant.threads()],
        "software": [mstar_version(), torch.__version__, tuning_cache.code_digest()],
    }
