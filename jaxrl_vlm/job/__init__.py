"""The main job, orchestration only: assets, the engine session, the learner, checkpoint cadence, the run loop.

Only the command line and the benches import `job` (the sharding bench trains with the learner's own settings):
it sits on top of the RL math (`rl/`), the engine, the rollout client and the data, and wires them together for
`jaxrl-vlm train | rollout`.
"""
