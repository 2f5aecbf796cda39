"""WeightSync operator: `kopf run -m weightsync_operator` (handlers register on import)."""

from weightsync_operator import handlers as handlers
