import sys
from sim.serving.simulate import build_serving, serving_result
from sim.replay.hardware import DEFAULT_GPU
from sim.replay.models import DEFAULT_MODEL
from traces.request_readers import read_request_trace
trace = read_request_trace(sys.argv[1])
setup = build_serving(trace, sys.argv[2], model=DEFAULT_MODEL, gpu=DEFAULT_GPU)
end_s = setup.server.run()
serving_result(setup, end_s=end_s, wall_s=0.0)
