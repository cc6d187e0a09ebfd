"""What a deployment may ask a model to do (`--task`), in a module of its own: the launcher
reads it through `shared.config` and must not import the specs (numpy) to do so."""

#: "auto": what the checkpoint is (a sentence-transformers folder embeds, a sequence
#: classifier scores, a decoder LM with a SNAC codec folder speaks, a robot policy acts, a world model rolls out,
#: anything else generates)
TASKS = ("auto", "generate", "embed", "score", "speech", "act", "rollout", "image")
