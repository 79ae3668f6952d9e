"""The two wire dialects: validation into DecisionRequest, exact error bodies, answer shapes."""
