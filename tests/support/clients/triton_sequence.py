"""Stream a sequence to an mhaserve server with tritonclient.grpc, unmodified, as a Triton user steps a sequence.

Runs in its own process (tritonclient's protobuf messages and mhaserve's cannot share one). Usage:
    python triton_sequence.py URL IN.npz OUT.npz unary|stream SEQUENCE_ID
IN.npz holds 'x' [B, L, d] and 'steps' (the rows of each step, summing to L). Each step sends its rows with
sequence_id, sequence_start on the first and sequence_end on the last; OUT.npz gets step<i>_output and
step<i>_attn_weights for every step, or 'error' with the first refusal's message.
"""

import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient

url, source, target, mode, sequence_id = sys.argv[1:6]
sequence_id = int(sequence_id) if sequence_id.isdigit() else sequence_id
data = np.load(source)
x, steps = data["x"], [int(n) for n in data["steps"]]
client = grpcclient.InferenceServerClient(url)
outputs = [grpcclient.InferRequestedOutput(name) for name in ("output", "attn_weights")]
answers, position = {}, 0
results = queue.Queue()
if mode == "stream":
    client.start_stream(callback=lambda result, error: results.put((result, error)))
try:
    for index, rows in enumerate(steps):
        query = grpcclient.InferInput("query", [x.shape[0], rows, x.shape[2]], "FP32")
        query.set_data_from_numpy(np.ascontiguousarray(x[:, position : position + rows]))
        flags = {"sequence_id": sequence_id, "sequence_start": index == 0, "sequence_end": index == len(steps) - 1}
        if mode == "stream":
            client.async_stream_infer("mha", [query], outputs=outputs, **flags)
            result, error = results.get(timeout=60)
            if error is not None:
                raise error
        else:
            result = client.infer("mha", [query], outputs=outputs, **flags)
        answers[f"step{index}_output"] = result.as_numpy("output")
        answers[f"step{index}_attn_weights"] = result.as_numpy("attn_weights")
        position += rows
except Exception as error:  # noqa: BLE001  (the refusal is the answer the test reads)
    answers = {"error": np.array(str(error))}
finally:
    if mode == "stream":
        client.stop_stream()
    client.close()
np.savez(target, **answers)
