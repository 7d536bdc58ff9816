"""What a reinforcement-learning trainer uses beside the engine: WeightSender, the
trainer's end of a weight transfer (LLM.init_weight_transfer / receive_weights)."""

from spindle.rl.weight_transfer import WeightSender

__all__ = ["WeightSender"]
