"""The TRACE library behind the pipeline steps (policy model, rollout engine,
guidance, QAT/RL, evaluation) and one thin KFP component per step."""
