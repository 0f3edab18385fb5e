"""`python -m envs.zoom.chance`: the zoom task's chance and best-blind rewards, printed (closed form; `grading`).
No jax."""

from __future__ import annotations

from envs.zoom.grading import best_blind_reward, chance_reward

if __name__ == "__main__":
    print(f"zoom: chance {chance_reward():.3f}, best blind {best_blind_reward():.3f}, reading the crop 1.000")
