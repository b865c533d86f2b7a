# CPU op benchmarks (Google Benchmark): Tally's matmul/linear against direct cblas calls.
# Included from bench/CMakeLists.txt.
add_executable(bench_cpu_ops bench_cpu_ops.cpp)
target_link_libraries(bench_cpu_ops PRIVATE tally benchmark::benchmark)
