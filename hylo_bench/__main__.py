from hylo_bench.cli import app

app(prog_name="hylo-bench")
