"""The trajectory viewer (`jaxrl-vlm view RUN_DIR [--export FILE.html]`): reads a run's dumps (`records`), renders
one HTML page (`render`), serves it with aiohttp or writes it self-contained (`server`). Never imports jax."""
