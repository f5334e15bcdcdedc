"""Chapter 15 exercises: CUDA graphs (minivllm/cuda_graphs.py) (your answers).

They run on a CPU too: with enforce_eager=False the engine takes the graphs' padded path eagerly.
"""

# Write your answers in this file, then check them: pytest exercises/ch15
# (the shipped solutions are in solutions/answers.py: try first)


# Exercise 15.1 (predict, then measure). max_num_seqs = 32: which graph bucket runs a decode step
# of 17 rows, and how many of its rows are padding? Tolerance: exact.
BUCKET_FOR_17 = None
PADDING_ROWS_FOR_17 = None


# Exercise 15.2 (predict, then measure). LLM(tiny model, enforce_eager=False, kv_memory=64 blocks'
# worth, block_size 16): the pool has 64 blocks; how many can the scheduler hand out? Tolerance: exact.
USABLE_BLOCKS = None


def check_graphs_agree(eager_ids, graph_ids) -> None:
    """Exercise 15.3 (find the bug): raise AssertionError unless the padded decode path (graph_ids)
    gave the same greedy tokens as the eager engine (eager_ids) for the same 3 prompts (3 rows: a
    bucket of 4, one padding row). Called once as it is, once with a defect planted in where the
    padding rows write."""
    raise NotImplementedError
