"""Serving benchmark (same as `pagemill bench serve`); see pagemill.server.bench.benchmark.

python benchmarks/serve.py --launch                      # start SmolLM2, run 1,4,16,64
python benchmarks/serve.py --base-url http://127.0.0.1:8000 --concurrency 1,8
"""

import sys

from pagemill.server.bench.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
