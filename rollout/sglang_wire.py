"""Facts of SGLang's native HTTP wire format shared by every server that speaks it here (the embedded engine,
the scripted fake) — reference/sglang_api.md §1-2. Pure data and tiny builders; no jax, no aiohttp."""

from __future__ import annotations

import time
from typing import Any

# GenerateReqInput field names (sglang io_struct.py). sgl-router 0.3.2 adds the last five to every body it
# forwards, and SGLang accepts them.
GENERATE_KEYS = frozenset({
    "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data", "sampling_params", "rid",
    "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs",
    "stream", "log_metrics", "modalities", "session_params", "session_id", "routing_key", "priority",
    "lora_path", "lora_id", "return_hidden_states", "return_routed_experts", "custom_logit_processor",
    "data_parallel_rank", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "model", "background", "no_logs", "return_bytes", "return_entropy",
})
# SamplingParams field names (sglang sampling_params.py).
SAMPLING_KEYS = frozenset({
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "stop", "stop_token_ids", "stop_regex", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n", "sampling_seed",
    "custom_params", "logit_bias", "json_schema", "regex", "ebnf", "structural_tag", "stream_interval",
})


def loads_response(*, version: str, running: int, waiting: int, used_tokens: int, max_total_tokens: int,
                   max_running_requests: int, **extra: Any) -> dict[str, Any]:
    """The body of `GET /v1/loads` (one data-parallel rank), which `SGLangClient.abort_all` polls until idle."""
    return {
        "timestamp": time.time(),
        "version": version,
        "dp_rank_count": 1,
        "loads": [{
            "dp_rank": 0,
            "num_running_reqs": running,
            "num_waiting_reqs": waiting,
            "num_total_reqs": running + waiting,
            "num_used_tokens": used_tokens,
            "max_total_num_tokens": max_total_tokens,
            "token_usage": used_tokens / max(1, max_total_tokens),
            "gen_throughput": 0.0,
            "cache_hit_rate": 0.0,
            "utilization": running / max(1, max_running_requests),
            "max_running_requests": max_running_requests,
            **extra,
        }],
    }
