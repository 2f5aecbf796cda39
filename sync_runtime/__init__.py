"""WeightSync runtime: layouts, planner, transfer engine, Ray participants and the coordinator."""
