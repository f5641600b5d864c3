"""The main job: `python examples/train_gpt.py --help` (also installed as `te-parallel-train-gpt`)."""
from te_parallel.examples.train_gpt import main

if __name__ == "__main__":
    main()
