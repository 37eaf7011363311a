import sys
from sim.serving.simulate import build_serving, serving_result
from traces.request_readers import read_request_trace
trace = read_request_trace(sys.argv[1])
setup = build_serving(trace, sys.argv[2], model="Llama-3-8B", gpu="H200")
end_s = setup.server.run()
serving_result(setup, end_s=end_s, wall_s=0.0)
