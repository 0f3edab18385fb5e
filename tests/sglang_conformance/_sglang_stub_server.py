"""SGLang 0.5.23's own HTTP server, with a scripted scheduler in place of the model. Run by the SGLang venv's python.

    .venv-sglang/bin/python tests/sglang_conformance/_sglang_stub_server.py --port-file PATH [--api-key KEY] \
        [SGLANG SERVER FLAGS...]   (parsed, resolved and checked by SGLang's ServerArgs, as at launch)

What is SGLang's here, unchanged: the FastAPI app of `sglang/srt/entrypoints/http_server.py` (every route, the
`/generate` schema gate, body parsing into `GenerateReqInput`, error handlers, API-key middleware, `/health`),
`GenerateReqInput.normalize_batch_and_arguments`, `SamplingParams.normalize/verify`, and the TokenizerManager's
own answer builders: `_handle_batch_output` (meta_info, log-prob triples, weight-version spans),
`_handle_abort_req` (the answer to a request aborted in the waiting queue), `pause_generation` /
`continue_generation` / `abort_request` with their pause condition and model-update lock, the finish
reasons of `schedule_batch.py`, the LoRA routes' tokenizer-manager side (`load_lora_adapter`, `unload_lora_adapter`,
LoRARegistry, `_validate_and_resolve_lora` on every /generate, `/update_weight_version`), and the detokenizer's
base64 encoding of routed experts (`DetokenizerManager._b64_encode_per_request`).

What is scripted (`StubScheduler`): the model. It "generates" token `(last_id + 1) % vocab` per step, one step every
`STEP_S`, and answers the scheduler messages the way `managers/scheduler.py` does: an abort of a waiting request
echoes an AbortReq (the tokenizer manager builds the queued-abort answer), an abort of a running one finishes it
with FINISH_ABORT; pause in abort mode aborts all, retract re-queues, in_place keeps them; a weight update
records weight-version events for requests alive across it. With `--enable-return-routed-experts` a request that
asks gets int32 [seqlen - 1, MOE_LAYERS, MOE_TOP_K] routed experts, as the capturer's `get_topk` hands them over.
A LoRA load reads the PEFT directory with SGLang's `LoRAConfig` and is checked as `LoRAManager.validate_new_adapter`
does (name taken, rank and targets against the memory pool via `LoRAMemoryPool.can_support`); the answer is
`create_lora_update_result`'s. `POST /stub/hold {"hold": true}` keeps new requests waiting (never scheduled), so a
test can abort a queued request on purpose; `GET /stub/seen[/RID]` says which adapter a request resolved to and
which routed experts it was given.

The lifespan of SGLang's app is replaced, so no scheduler or detokenizer process starts. The chosen port is
written to `--port-file` once uvicorn listens.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "standins"))
import sglang_standins  # noqa: E402

sglang_standins.install()

os.environ.setdefault("SGLANG_HEALTH_CHECK_TIMEOUT", "3")  # SGLang's default is 20 s; the tests wait for it

import torch  # noqa: E402
import uvicorn  # noqa: E402
from contextlib import asynccontextmanager  # noqa: E402
from fastapi import Request  # noqa: E402
from transformers import Qwen3VLConfig  # noqa: E402

from sglang.srt.entrypoints import http_server  # noqa: E402
from sglang.srt.lora.lora_config import LoRAConfig  # noqa: E402
from sglang.srt.lora.lora_registry import LoRARef  # noqa: E402
from sglang.srt.lora.mem_pool import LoRAMemoryPool  # noqa: E402
from sglang.srt.lora.utils import get_normalized_target_modules  # noqa: E402
from sglang.srt.managers.detokenizer_manager import DetokenizerManager  # noqa: E402
from sglang.srt.managers.io_struct import (  # noqa: E402
    AbortReq,
    BatchStrOutput,
    ContinueGenerationReqInput,
    LoadLoRAAdapterReqInput,
    LoRAUpdateOutput,
    PauseGenerationReqInput,
    UpdateWeightVersionReqOutput,
)
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, FINISH_MATCHED_TOKEN  # noqa: E402
from sglang.srt.managers.tokenizer_manager import ReqState, ServerStatus, TokenizerManager  # noqa: E402
from sglang.srt.runtime_context import get_exec, get_lora  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.utils.weight_versions import WeightVersionEvent, compute_weight_version_spans  # noqa: E402

VOCAB_SIZE = 151936  # Qwen3-VL's
EOS_ID = 2
STEP_S = 0.02
# The MoE the stand-in "routes" through (return_routed_experts): what RoutedExpertsCapturer reads from the text config
# (num_hidden_layers, num_experts_per_tok); 512 experts, so ids above one byte.
MOE_LAYERS, MOE_TOP_K, MOE_EXPERTS = 3, 2, 512
from sglang.srt.managers.load_snapshot import LoadSnapshot  # noqa: E402
from sglang.srt.managers.io_struct import FlushCacheReqOutput  # noqa: E402


def routed_experts(token_ids: list[int]) -> torch.Tensor:
    """What the capturer's host cache gives a finished request (`get_topk`): int32 [seqlen - 1, layers, top_k], a row
    per forwarded position (the last token never was). Made up from each position and its token, so a prefix that
    two requests share routes alike, as SGLang's cache keyed by KV slot does."""
    ids = torch.tensor(token_ids[:-1], dtype=torch.int64).view(-1, 1, 1)
    pos = torch.arange(ids.shape[0]).view(-1, 1, 1)
    layer, k = torch.arange(MOE_LAYERS).view(1, -1, 1), torch.arange(MOE_TOP_K).view(1, 1, -1)
    return ((ids * 131 + pos * 7 + layer * 17 + k * 257) % MOE_EXPERTS).to(torch.int32)


class _ByteTokenizer:
    """What SamplingParams.normalize asks of a tokenizer (stop-string lengths): one token per UTF-8 byte."""

    eos_token_id = EOS_ID

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())


class _Running:
    """One request the stub scheduler holds: its state in the tokenizer manager and what it has generated."""

    def __init__(self, rid: str, state: ReqState, input_ids: list[int], params: SamplingParams,
                 return_routed_experts: bool = False) -> None:
        self.rid, self.state, self.params = rid, state, params
        self.input_ids = list(input_ids)
        self.return_routed_experts = return_routed_experts
        self.prompt_tokens = len(input_ids)
        self.last_id = input_ids[-1]
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.events: list[WeightVersionEvent] = []
        self.running = False  # False: in the waiting queue


class StubScheduler:
    """The model and scheduler, scripted: one token per step, SGLang's answers to abort / pause / weight update."""

    def __init__(self, tm: StubTokenizerManager) -> None:
        self.tm = tm
        self.reqs: dict[str, _Running] = {}
        self.hold = False  # new requests stay in the waiting queue
        self.paused_mode: str | None = None
        self.memory_released = False
        # RoutedExpertsCapturer.create: no capturer (and no routed_experts) without --enable-return-routed-experts.
        self.captures_experts = bool(get_exec().features.enable_return_routed_experts)
        self.lora_refs: dict[str, LoRARef] = {}  # LoRAManager.lora_refs: the adapters loaded, by lora_id
        self.seen: dict[str, dict[str, Any]] = {}  # per rid, what the scheduler got and produced (GET /stub/seen/RID)

    def add(self, req: _Running) -> None:
        self.reqs[req.rid] = req
        asyncio.get_running_loop().create_task(self._run(req))

    async def _run(self, req: _Running) -> None:
        while req.rid in self.reqs:
            await asyncio.sleep(STEP_S)
            if req.rid not in self.reqs or self.hold and not req.running or self.paused_mode is not None:
                continue
            req.running = True
            token = (req.last_id + 1) % VOCAB_SIZE
            req.last_id = token
            req.output_ids.append(token)
            req.logprobs.append(-0.25)
            finish = None
            if token in (req.params.stop_token_ids or set()) or token == EOS_ID and not req.params.ignore_eos:
                finish = FINISH_MATCHED_TOKEN(matched=token).to_json()
            elif len(req.output_ids) >= req.params.max_new_tokens:
                finish = FINISH_LENGTH(length=req.params.max_new_tokens).to_json()
            if finish is not None:
                await self.finish(req, finish)

    async def finish(self, req: _Running, finish_reason: dict[str, Any]) -> None:
        """Send the request's output as the detokenizer does: one BatchStrOutput, through SGLang's builder."""
        del self.reqs[req.rid]
        n = len(req.output_ids)
        version = self.tm.config_value("weight_version")
        spans = compute_weight_version_spans(req.events, version, n) if req.events else None
        routed = None
        if self.captures_experts and req.return_routed_experts:  # batch_result_processor._maybe_collect_routed_experts
            routed = routed_experts(req.input_ids + req.output_ids)
            self.seen.setdefault(req.rid, {})["routed_experts"] = {
                "ids": routed.tolist(), "shape": list(routed.shape), "dtype": str(routed.dtype)}
        out = BatchStrOutput(
            rids=[req.rid], finished_reasons=[finish_reason],
            output_strs=[" ".join(f"t{t}" for t in req.output_ids)], output_ids=[array("l", req.output_ids)],
            prompt_tokens=[req.prompt_tokens], completion_tokens=[n], reasoning_tokens=[0], cached_tokens=[0],
            input_token_logprobs_val=[[]], input_token_logprobs_idx=[[]],
            output_token_logprobs_val=[list(req.logprobs)], output_token_logprobs_idx=[list(req.output_ids)],
            input_top_logprobs_val=[[]], input_top_logprobs_idx=[[]], output_top_logprobs_val=[[]],
            output_top_logprobs_idx=[[]], input_token_ids_logprobs_val=[[]], input_token_ids_logprobs_idx=[[]],
            output_token_ids_logprobs_val=[[]], output_token_ids_logprobs_idx=[[]], output_token_entropy_val=None,
            output_token_sampling_mask=None, output_hidden_states=None, indexer_topk=None,
            # The detokenizer's encoding of the scheduler's per-request tensors (handle_batch_token_id_out).
            routed_experts=DetokenizerManager._b64_encode_per_request(None if routed is None else [routed]),
            placeholder_tokens_idx=None, placeholder_tokens_val=None, retraction_counts=[0],
            weight_versions=None if spans is None else [spans],
        )
        self.tm.last_receive_tstamp = time.time()
        await self.tm._handle_batch_output(out)

    def abort(self, rid: str, abort_all: bool, message: str | None = None) -> None:
        """scheduler.abort_request: a waiting request is echoed back as an AbortReq (the tokenizer manager builds
        "Abort in waiting queue"), a running one finishes with FINISH_ABORT at the next step."""
        for req in [r for r in self.reqs.values() if abort_all or r.rid == rid]:
            if not req.running:
                del self.reqs[req.rid]
                self.tm.last_receive_tstamp = time.time()
                self.tm._handle_abort_req(AbortReq(rid=req.rid, abort_message=message))
            else:
                asyncio.get_running_loop().create_task(
                    self.finish(req, FINISH_ABORT(message or "Abort before prefill").to_json()))

    # ---- LoRA: the scheduler's LoRAManager (load_lora_adapter / unload_lora_adapter), on the adapter's own files
    async def update_lora_adapter(self, obj: Any) -> list[LoRAUpdateOutput]:
        """TokenizerManager.update_lora_adapter_communicator: one rank's answer to a load or an unload."""
        ref = obj.to_ref()
        if not isinstance(obj, LoadLoRAAdapterReqInput):
            self.lora_refs.pop(ref.lora_id, None)
            return [self._lora_result(True)]
        try:
            config = LoRAConfig(ref.lora_path, base_vocab_size=VOCAB_SIZE)  # SGLang's own adapter_config.json reader
            self._validate_adapter(config, ref)
            if not (Path(ref.lora_path) / "adapter_model.safetensors").is_file():
                raise ValueError(f"{ref.lora_path} has no adapter_model.safetensors")
        except Exception as e:  # LoRAManager._load_lora_adapter answers any failure as success=False
            return [self._lora_result(False, str(e))]
        self.lora_refs[ref.lora_id] = ref
        return [self._lora_result(True)]

    def _validate_adapter(self, config: LoRAConfig, ref: LoRARef) -> None:
        """LoRAManager.validate_new_adapter, its checks in its order and words; the pool check is SGLang's own
        LoRAMemoryPool.can_support over the server's --max-lora-rank / --lora-target-modules."""
        if config.lora_added_tokens_size > 0:
            raise ValueError(f"Failed to load {ref.lora_name} because LoRA serving currently doesn't support "
                             "adapters that add tokens to the vocabulary")
        if config.use_dora:
            raise ValueError(f"Failed to load {ref.lora_name} because LoRA serving currently doesn't support DoRA "
                             "adapters")
        if any(r.lora_name == ref.lora_name for r in self.lora_refs.values()):
            raise ValueError(f"Failed to load LoRA adapter {ref.lora_name} because it is already loaded")
        lora = get_lora()
        targets = set(lora.lora_target_modules or ())
        pool = type("Pool", (), {"max_lora_rank": lora.max_lora_rank, "lora_added_tokens_size": 0,
                                 # "all" resolves to every module of the model (auto_detect_lora_target_modules)
                                 "target_modules": {"all"} if "all" in targets
                                 else get_normalized_target_modules(targets)})()
        if "all" not in pool.target_modules and not LoRAMemoryPool.can_support(pool, config) \
                or config.r > pool.max_lora_rank:
            raise ValueError(f"LoRA adapter {ref.lora_name} with rank {config.r} is incompatible with the current "
                             "LoRA memory pool configuration. Please ensure that the LoRA adapter's rank is within the "
                             "configured `--max-lora-rank` and that the target modules are included in "
                             "`--lora-target-modules`.")

    def _lora_result(self, success: bool, error_message: str = "") -> LoRAUpdateOutput:
        """LoRAManager.create_lora_update_result: loaded_adapters maps each loaded name to its path."""
        return LoRAUpdateOutput(success=success, error_message=error_message,
                                loaded_adapters={r.lora_name: r.lora_path for r in self.lora_refs.values()})

    def update_weights(self, old_version: str) -> None:
        """A weight change under requests that have output (pause retract / in_place): record the event."""
        for req in self.reqs.values():
            if req.output_ids:
                req.events.append(WeightVersionEvent(old_version=old_version, num_output_tokens=len(req.output_ids)))


class StubTokenizerManager(TokenizerManager):
    """SGLang's TokenizerManager without its __init__ (no tokenizer, no zmq, no scheduler process): its own
    request states, pause condition, model-update lock and answer builders, fed by `StubScheduler`."""

    def __new__(cls, *args: Any, **kwargs: Any) -> StubTokenizerManager:
        return object.__new__(cls)

    def __init__(self, server_args: ServerArgs) -> None:  # noqa: D107 - the parent's __init__ is not run on purpose
        self.server_args = server_args
        self.elastic_worker_count = 1
        self.startup_time = {"server_ready": time.time()}
        self.init_running_status()
        self.init_weight_update()
        self.init_request_logging_and_dumping()
        self.server_status = ServerStatus.Up
        self.scheduler = StubScheduler(self)
        self.versions = {"weight_version": server_args.weight_version, "load_format": "auto"}
        self.model_path = server_args.model_path
        self.served_model_name = server_args.model_path
        self.is_generation = True
        self.enable_metrics = False
        self.enable_lora = bool(get_lora().enable_lora)
        self.init_lora()
        self._lora_release_tasks: set[asyncio.Task] = set()
        self.update_lora_adapter_communicator = self.scheduler.update_lora_adapter
        self.update_weight_version_communicator = self._update_weight_version_in_scheduler
        self.crash_dump_folder = None
        self.enable_trace = False
        self.skip_tokenizer_init = True
        self.incremental_streaming_output = False
        self.tokenizer = None
        self.disaggregation_mode = "null"
        self.model_config = type("StubModelConfig", (), {
            "is_image_understandable_model": True, "is_audio_understandable_model": False, "context_len": 4096,
            "hf_config": type("StubHFConfig", (), {"model_type": "qwen3_vl",
                                                    "architectures": ["Qwen3VLForConditionalGeneration"]})(),
        })()

    # ---- what SGLang's __init__ would have set up
    def config_value(self, name: str) -> Any:
        return self.versions.get(name)

    def record_config_updates(self, source: str, **fields: Any) -> None:
        self.versions.update(fields)

    async def _update_weight_version_in_scheduler(self, obj: Any) -> list[UpdateWeightVersionReqOutput]:
        """scheduler.handle_update_weight_version: requests alive across the change get a weight-version event."""
        old = self.versions["weight_version"]
        if obj.new_version != old:
            self.scheduler.update_weights(old)
        return [UpdateWeightVersionReqOutput()]

    def auto_create_handle_loop(self) -> None:
        return None

    def _dispatch_to_scheduler(self, obj: Any) -> None:
        if isinstance(obj, AbortReq):
            self.scheduler.abort(obj.rid, obj.abort_all)
        elif isinstance(obj, PauseGenerationReqInput):
            self._pause(obj.mode)
        elif isinstance(obj, ContinueGenerationReqInput):
            self.scheduler.paused_mode = None

    async def _async_dispatch_to_scheduler(self, obj: Any) -> None:
        self._dispatch_to_scheduler(obj)

    def _pause(self, mode: str) -> None:
        """scheduler.pause_generation: retract re-queues running requests, in_place keeps them; both stop steps."""
        self.scheduler.paused_mode = mode
        if mode == "retract":
            for req in self.scheduler.reqs.values():
                req.running = False

    # ---- /generate
    async def generate_request(self, obj: Any, request: Request | None = None):
        obj.normalize_batch_and_arguments()
        if not obj.is_single:
            raise ValueError("the stub serves one prompt per request")
        self._init_req_state(obj, request)
        state = self.rid_to_state[obj.rid]
        try:
            async with self.is_pause_cond:
                await self.is_pause_cond.wait_for(lambda: not self.is_pause)
            async with self.model_update_lock.reader_lock:
                await self._validate_and_resolve_lora(obj)  # SGLang's: lora_path -> lora_id, or a refusal
                if obj.input_ids is None:
                    raise ValueError("the stub takes input_ids only")
                params = SamplingParams(**(obj.sampling_params or {}))
                params.normalize(_ByteTokenizer())
                params.verify(VOCAB_SIZE)
                adapter = self.scheduler.lora_refs.get(obj.lora_id) if obj.lora_id else None
                self.scheduler.seen[obj.rid] = {"lora_path": obj.lora_path, "lora_id": obj.lora_id,
                                                "adapter_dir": adapter.lora_path if adapter else None,
                                                "image_data": obj.image_data, "video_data": obj.video_data}
                self.scheduler.add(_Running(obj.rid, state, list(obj.input_ids), params,
                                            return_routed_experts=obj.return_routed_experts))
                await state.event.wait()
        except BaseException:
            self.rid_to_state.pop(obj.rid, None)
            self.scheduler.reqs.pop(obj.rid, None)
            raise
        yield state.out_list[-1]

    def create_abort_task(self, obj: Any) -> Any:
        return None

    # ---- control
    async def flush_cache(self, timeout_s: float = 0.0) -> FlushCacheReqOutput:
        """scheduler.flush_cache: only when fully idle, the waiting queue ignored while paused (retracted
        requests wait there); an in_place pause keeps requests running, so it fails."""
        reqs = self.scheduler.reqs.values()
        paused = self.scheduler.paused_mode is not None
        busy = any(r.running or not paused for r in reqs)
        return FlushCacheReqOutput(success=not busy, message="" if not busy else "Flush cache failed.\n")

    async def update_weights_from_disk(self, obj: Any, request: Any = None) -> tuple[bool, str, int]:
        if obj.abort_all_requests:
            self.abort_request(abort_all=True)
        async with self.model_update_lock.writer_lock if not self.is_pause else _NoLock():
            old = self.versions["weight_version"]
            self.scheduler.update_weights(old)
            if obj.weight_version is not None:
                self.versions["weight_version"] = obj.weight_version
            self.model_path = obj.model_path
            return True, "Succeeded to update model weights.", len(self.scheduler.reqs)

    async def release_memory_occupation(self, obj: Any, request: Any = None) -> None:
        self.scheduler.memory_released = True

    async def resume_memory_occupation(self, obj: Any, request: Any = None) -> None:
        self.scheduler.memory_released = False

    async def get_internal_state(self) -> list[dict[str, Any]]:
        return [{"max_req_input_len": 4096, "max_total_num_tokens": 8192}]

    async def get_loads(self, include: Any = None, dp_rank: Any = None) -> list[LoadSnapshot]:
        running = sum(r.running for r in self.scheduler.reqs.values())
        return [LoadSnapshot(timestamp=time.time(), num_running_reqs=running,
                             num_waiting_reqs=len(self.scheduler.reqs) - running,
                             max_total_num_tokens=8192, max_running_requests=64)]


class _NoLock:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


def _hold_route(tm: StubTokenizerManager) -> Any:
    async def hold(request: Request) -> dict[str, Any]:
        tm.scheduler.hold = bool((await request.json()).get("hold"))
        return {"hold": tm.scheduler.hold}

    return hold


def _seen_route(tm: StubTokenizerManager) -> Any:
    """GET /stub/seen/RID: the adapter the request resolved to, its pictures and clips as SGLang normalized them, and
    the routed experts produced for it."""
    async def seen(rid: str) -> dict[str, Any]:
        return tm.scheduler.seen.get(rid, {})

    return seen


def _seen_rids_route(tm: StubTokenizerManager) -> Any:
    async def rids() -> list[str]:
        return list(tm.scheduler.seen)

    return rids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--api-key", default=None)
    args, server_flags = parser.parse_known_args()  # the rest: SGLang server flags, as our launcher passes them

    model_dir = tempfile.mkdtemp(prefix="sglang-stub-model-")
    Qwen3VLConfig(architectures=["Qwen3VLForConditionalGeneration"]).save_pretrained(model_dir)  # read by ServerArgs
    sglang_parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(sglang_parser)
    server_args = ServerArgs.from_cli_args(sglang_parser.parse_args(
        ["--model-path", model_dir, "--weight-version", "default", "--skip-server-warmup", "--device", "cpu",
         *(["--api-key", args.api_key] if args.api_key else []), *server_flags]))
    # What Engine._launch_subprocesses does before publishing: resolution, then SGLang's argument checks
    # (check_lora_server_args among them).
    server_args.resolve_once()
    server_args.check_server_args()
    from sglang.srt.runtime_context import publish
    publish(server_args, role="tokenizer")
    tm = StubTokenizerManager(server_args)

    @asynccontextmanager
    async def lifespan(_app: Any):
        yield

    app = http_server.app
    app.router.lifespan_context = lifespan
    app.is_single_tokenizer_mode = True
    app.server_args = server_args
    app.add_api_route("/stub/hold", _hold_route(tm), methods=["POST"])
    app.add_api_route("/stub/seen", _seen_rids_route(tm), methods=["GET"])
    app.add_api_route("/stub/seen/{rid}", _seen_route(tm), methods=["GET"])
    http_server.set_global_state(http_server._GlobalState(tokenizer_manager=tm, template_manager=None,
                                                          scheduler_info={}))
    if args.api_key:
        from sglang.srt.utils.auth import add_api_key_middleware
        add_api_key_middleware(app, api_key=args.api_key, admin_api_key=None)

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", loop="asyncio")
    server = uvicorn.Server(config)

    async def serve() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        Path(args.port_file).write_text(str(port))
        await task

    asyncio.run(serve())


if __name__ == "__main__":
    main()
