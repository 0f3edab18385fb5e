"""The complete argument list of slime's geo3k VLM multi-turn run line
(`examples/geo3k_vlm_multi_turn/run_geo3k_vlm_multi_turn.py` in the slime repository), group by group, as the
script assembles it: checkpoint, rollout, the commented-out eval group, GRPO, optimizer, sglang, the FSDP or
Megatron backend group, misc and wandb. Values are the script's own (NUM_GPUS = 4)."""

from __future__ import annotations

import shlex

MODEL = "/root/models/Qwen3-VL-2B-Instruct"
TRAIN_DATA = "/root/datasets/geo3k_imgurl_processed/train.parquet"

CKPT = f"--hf-checkpoint {MODEL}"
WANDB = "--use-wandb --wandb-project slime-dev --wandb-group geo3k_vlm_multi_turn --wandb-key ${WANDB_API_KEY}"
ROLLOUT = (
    f"--prompt-data {TRAIN_DATA} --input-key problem --label-key answer "
    """--multimodal-keys '{"image": "images"}' --rm-type math --apply-chat-template """
    "--custom-generate-function-path examples.geo3k_vlm_multi_turn.rollout.generate "
    "--custom-config-path examples/geo3k_vlm_multi_turn/geo3k_vlm_multi_turn_config.yaml "
    "--rollout-shuffle --num-rollout 3000 --rollout-batch-size 64 --n-samples-per-prompt 8 "
    "--rollout-max-response-len 4096 --rollout-temperature 1 --global-batch-size 512"
)
EVAL = (
    f"--eval-interval 20 --eval-prompt-data geo3k_eval {TRAIN_DATA}@[0:64] --n-samples-per-eval-prompt 1 "
    "--eval-max-response-len 4096 --eval-top-k 1"
)
GRPO = (
    "--advantage-estimator grpo --kl-loss-coef 0.00 --kl-loss-type low_var_kl --kl-coef 0.00 --entropy-coef 0.00 "
    "--eps-clip 0.2 --eps-clip-high 0.28"
)
OPTIMIZER = "--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98"
SGLANG = (
    "--rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.6 --sglang-cuda-graph-bs "
    + " ".join(map(str, [1, 2, 4, 8, *range(16, 257, 8)]))
)
FSDP = (
    "--train-backend fsdp --gradient-checkpointing --sglang-attention-backend fa3 "
    "--attn-implementation flash_attention_3 --update-weight-buffer-size 536870912"
)
MEGATRON = (
    f"--train-backend megatron --load {MODEL} --tensor-model-parallel-size 4 --sequence-parallel "
    "--pipeline-model-parallel-size 1 --context-parallel-size 1 --expert-model-parallel-size 1 "
    "--expert-tensor-parallel-size 1 --recompute-granularity full --recompute-method uniform "
    "--recompute-num-layers 1 --use-dynamic-batch-size --max-tokens-per-gpu 4096 --attention-dropout 0.0 "
    "--hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32 --attention-backend flash "
    "--megatron-to-hf-mode bridge"
)
MISC = "--actor-num-nodes 1 --actor-num-gpus-per-node 4 --rollout-num-gpus 4 --colocate"


def argv(backend: str, wandb_key: str = "test-key") -> list[str]:
    """The whole run line for `backend` ("fsdp" or "megatron"), eval group included, split as a shell would."""
    groups = [CKPT, ROLLOUT, EVAL, OPTIMIZER, GRPO, SGLANG, FSDP if backend == "fsdp" else MEGATRON, MISC, WANDB]
    return shlex.split(" ".join(groups).replace("${WANDB_API_KEY}", wandb_key))


def flags() -> list[str]:
    """Every distinct flag the script uses (both backends)."""
    seen: dict[str, None] = {}
    for backend in ("fsdp", "megatron"):
        for token in argv(backend):
            if token.startswith("--"):
                seen[token] = None
    return list(seen)
