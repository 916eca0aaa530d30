# The two commands of the README's quick start, and a few conveniences.
.PHONY: demo test build clean wheel

demo:  ## the main job: the JAX training demo (SIGKILL, resume on another mesh), the C++ example, tensorstash ls/inspect/verify
	scripts/run_demo.sh

test:  ## every test (installs what it needs first)
	scripts/run_tests.sh

build:
	scripts/setup.sh build

wheel:  ## a portable wheel in dist/ (the native libraries bundled; scripts/build_wheel.sh)
	scripts/build_wheel.sh

clean:
	rm -rf build demo_checkpoints dist

.PHONY: bench
bench:  ## the benchmark against Orbax + TensorStore (bench/README.md); extra flags: BENCH_ARGS="--scale 0.5"
	scripts/run_bench.sh $(BENCH_ARGS)
