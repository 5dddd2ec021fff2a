"""Research recipes, apart from the product: the demo, the paper reproduction (reproduce runs the jobs,
reproduce_report reads their results), the subprocess runner they share (orchestrate), and the source-model recipes
(llama2.c converter, byte-level English pretraining, tiny models from real configs)."""
