"""LoRA: low-rank adapters on the policy's linear layers, trained on a frozen base.

One adapter per HF linear layer (a `Link` whose tensor is a torch Linear weight), in PEFT's own layout: lora_A
[r, in], lora_B [out, r], update scale * B @ A on the torch weight [out, in]. The model code is untouched: the
adapters enter as a weight update (`adapters.merged_params`), computed inside the compiled step so only the adapters
get gradients and optimizer state, and the reference policy is the base itself (the adapters off). The same update
serves the embedded engine (adapter-only weight sync) and the exports (`export.py`: a PEFT adapter directory, a
merged HF model). `options.py` holds the user's options (no jax); `serving.py` the server arguments a launched SGLang or
vLLM needs to serve the adapters (the weight syncer sends those engines one PEFT directory per version).
"""
