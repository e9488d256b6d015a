"""benchmarks/peers.py's parts (titanscale side by side with TRL, transformers and skyrl-tx):
config (shared facts), measure (timers, CPU, spreads), harness (context, base, train.py side,
servers), pairs (what each comparison runs and reports), hf_workers / gen_worker /
tinker_workers (the processes of each side), workers (the registry), report (.md / .json),
cli (the command)."""
