"""World models (V-JEPA 2-AC): a video encoder and an action-conditioned predictor."""
