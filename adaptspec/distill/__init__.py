"""Draft co-design (distillation of a draft for a given target). Not built yet: see README "Status"."""
