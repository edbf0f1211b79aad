"""The Python client (`import memfl`, python/memfl_module.cpp) against a real
`memfl server`: one Python client (examples/pytorch_client.py, a PyTorch CNN)
and two C++ clients train Fashion-MNIST federatedly; a state_dict that is not
the server's model is refused by name before a byte moves."""
import json
import os
import socket
import struct
import subprocess
import sys

import pytest
import torch

import memfl

BIN = os.environ["MEMFL_BINARY"]
SRC = os.environ["MEMFL_SOURCE_DIR"]
sys.path.insert(0, os.path.join(SRC, "examples"))
from pytorch_client import CNN  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(path, port, rounds=3, steps=60):
    text = open(os.path.join(SRC, "configs/fedavg_fmnist_cnn.yaml")).read()
    text = text.replace("127.0.0.1:50051", f"127.0.0.1:{port}")
    text = text.replace("num_clients: 10", "num_clients: 3").replace("num_global_epochs: 5", f"num_global_epochs: {rounds}")
    text = text.replace("mode: epoch", "mode: step\n    num_local_steps: %d" % steps)
    text = text.replace("do_validation: true", "do_validation: false")
    path.write_text(text)
    return str(path)


def final_accuracy(metrics_csv):
    rows = [l.strip().split(",") for l in open(metrics_csv) if l.strip()]
    header, last = rows[0], rows[-1]
    return int(last[header.index("clients")]), float(last[header.index("test_accuracy")]), len(rows) - 1


def test_a_python_client_and_two_cpp_clients_train_as_three_cpp_clients(tmp_path):
    port = free_port()
    cfg = write_config(tmp_path / "c.yaml", port)
    common = ["--set", "client_configs.data_configs.dataset_kwargs.max_test_samples=2000"]
    server = subprocess.Popen([BIN, "server", cfg, "-q", "--out", str(tmp_path / "server")] + common)
    cpp = [subprocess.Popen([BIN, "client", cfg, "--client-id", str(i), "-q", "--out", str(tmp_path / f"c{i}")])
           for i in (1, 2)]
    py = subprocess.run([sys.executable, os.path.join(SRC, "examples/pytorch_client.py"), "--server",
                         f"127.0.0.1:{port}", "--client-id", "0", "--num-clients", "3", "--steps", "60",
                         "--json", str(tmp_path / "py.json")], capture_output=True, text=True, timeout=600)
    assert py.returncode == 0, py.stdout + py.stderr
    for p in cpp:
        assert p.wait(timeout=300) == 0
    assert server.wait(timeout=300) == 0
    clients, acc_mixed, rounds = final_accuracy(tmp_path / "server/metrics.csv")
    assert (clients, rounds) == (3, 3)
    # The same experiment with three C++ clients.
    port2 = free_port()
    cfg2 = write_config(tmp_path / "c2.yaml", port2)
    r = subprocess.run([BIN, "launch", cfg2, "--clients", "3", "-q", "--out", str(tmp_path / "cpp3")] + common,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    _, acc_cpp, _ = final_accuracy(tmp_path / "cpp3/server/metrics.csv")
    assert acc_cpp > 0.7 and acc_mixed > 0.7
    assert abs(acc_mixed - acc_cpp) < 0.05, (acc_mixed, acc_cpp)
    # The Python client held the model once plus chunks: its peak above its
    # baseline (interpreter, torch, data) is a few models at most here, not
    # a copy per transfer.
    rec = json.load(open(tmp_path / "py.json"))
    assert len(rec["rounds"]) == 3
    assert rec["peak_rss_bytes"] - rec["baseline_rss_bytes"] < 64 * rec["model_bytes"] + (64 << 20)


def test_a_python_client_alone_trains_the_model(tmp_path):
    # The mixed run above cannot tell a Python client that trains from one
    # that sends back the model it received (the two C++ clients would carry
    # the accuracy): alone, an untrained CNN stays near chance (0.1).
    port = free_port()
    cfg = write_config(tmp_path / "c.yaml", port)
    common = ["--set", "client_configs.data_configs.dataset_kwargs.max_test_samples=2000",
              "--set", "server_configs.num_clients=1"]
    server = subprocess.Popen([BIN, "server", cfg, "-q", "--out", str(tmp_path / "server")] + common)
    try:
        py = subprocess.run([sys.executable, os.path.join(SRC, "examples/pytorch_client.py"), "--server",
                             f"127.0.0.1:{port}", "--client-id", "0", "--num-clients", "1", "--steps", "60",
                             "--json", str(tmp_path / "py.json")], capture_output=True, text=True, timeout=600)
        assert py.returncode == 0, py.stdout + py.stderr
        assert server.wait(timeout=300) == 0
    finally:
        if server.poll() is None:
            server.kill()
    rows = [l.strip().split(",") for l in open(tmp_path / "server/metrics.csv") if l.strip()]
    header = rows[0]
    first = float(rows[1][header.index("test_accuracy")])
    clients, last, rounds = final_accuracy(tmp_path / "server/metrics.csv")
    assert (clients, rounds) == (1, 3)
    assert last > 0.6, last
    assert last > first, (first, last)


def write_safetensors(path, tensors):
    """A safetensors file written here, independently of memfl's writer."""
    header, offset, blobs = {}, 0, []
    for name, t in tensors.items():
        blob = t.contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    return {k: torch.frombuffer(bytearray(data[v["data_offsets"][0]:v["data_offsets"][1]]), dtype=torch.float32)
            .reshape(v["shape"]) for k, v in header.items() if k != "__metadata__"}


@pytest.mark.parametrize("channel", ["grpc", "tcp"])
def test_a_state_dict_that_is_not_the_servers_model_is_refused_by_name(tmp_path, channel):
    # The server starts from weights this test chose (model_configs.initial_model),
    # so what receive() writes into each tensor can be checked value by value —
    # tensors of 10 to 524 288 floats, with padding between them in the arena.
    # channel tcp: the chunks travel on the TCP data channel (data_channel: tcp).
    torch.manual_seed(3)
    start = CNN().state_dict()
    write_safetensors(tmp_path / "start.safetensors", start)
    port = free_port()
    cfg = write_config(tmp_path / "c.yaml", port, rounds=1)
    server = subprocess.Popen([BIN, "server", cfg, "-q", "--out", str(tmp_path / "server"), "--set",
                               "server_configs.num_clients=1", "--set",
                               f"client_configs.model_configs.initial_model={tmp_path / 'start.safetensors'}",
                               "--set", f"server_configs.comm_configs.grpc_configs.data_channel={channel}"])
    try:
        client = memfl.Client(f"127.0.0.1:{port}", client_id="0")
        names = [n for n, _, _ in client.layout]
        assert names == list(CNN().state_dict().keys())
        assert client.next_round() == 1
        sd = CNN().state_dict()
        wrong = dict(sd)
        wrong["fc2.weight"] = torch.zeros(5, 512)
        with pytest.raises(ValueError, match=r"fc2\.weight.*\[5, 512\].*\[10, 512\]"):
            client.receive(wrong)
        missing = {k: v for k, v in sd.items() if k != "conv2.bias"}
        with pytest.raises(ValueError, match=r"no tensor 'conv2\.bias'"):
            client.receive(missing)
        extra = dict(sd)
        extra["head.weight"] = torch.zeros(2)
        with pytest.raises(ValueError, match=r"'head\.weight' is not in the server's model"):
            client.receive(extra)
        as_double = {k: v.double() for k, v in sd.items()}
        with pytest.raises(ValueError, match=r"is torch\.float64; the server's model has f32"):
            client.receive(as_double)
        # Nothing was lost: the right tensors still receive the model, which is
        # the server's starting point, every value in place.
        client.receive(sd)
        for k in start:
            assert torch.equal(sd[k], start[k]), k
        # What is sent is what the server folds: one client, so the new global
        # model is that update (to float rounding of the weighted mean).
        sent = {k: (v * 2 + 0.5).contiguous() for k, v in sd.items()}
        client.send(sent, num_samples=10.0, metrics={"train_loss": 1.0})
        assert client.next_round() == -1
        client.close()
        assert server.wait(timeout=120) == 0
        final = read_safetensors(tmp_path / "server/global_model.safetensors")
        assert sorted(final) == sorted(sent)
        for k in sent:
            assert torch.allclose(final[k], sent[k], rtol=1e-6, atol=0), k
    finally:
        if server.poll() is None:
            server.kill()


def test_tls_and_a_token_as_for_the_cpp_client(tmp_path):
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    port = free_port()
    cfg = write_config(tmp_path / "c.yaml", port, rounds=1)
    g = "server_configs.comm_configs.grpc_configs."
    server = subprocess.Popen([BIN, "server", cfg, "-q", "--out", str(tmp_path / "server"),
                               "--set", "server_configs.num_clients=1", "--set", g + "use_ssl=true",
                               "--set", f"{g}server_cert={cert}", "--set", f"{g}server_key={key}",
                               "--set", f"{g}root_cert={cert}", "--set", g + "auth_token=s3cret"])
    try:
        with pytest.raises(RuntimeError, match="refused"):
            memfl.Client(f"127.0.0.1:{port}", client_id="0", token="wrong", root_cert=str(cert))
        client = memfl.Client(f"127.0.0.1:{port}", client_id="0", token="s3cret", root_cert=str(cert))
        sd = CNN().state_dict()
        played = []
        for rnd in client.rounds():
            client.receive(sd)
            client.send(sd, num_samples=1.0)
            played.append(rnd)
        assert played == [1]
        assert server.wait(timeout=120) == 0
        clients, _, rounds = final_accuracy(tmp_path / "server/metrics.csv")
        assert (clients, rounds) == (1, 1)
    finally:
        if server.poll() is None:
            server.kill()


def test_a_refused_update_raises_and_an_abandoned_round_still_exits(tmp_path):
    # send() with values or a sample count the server would refuse raises at
    # once, naming the tensor or the count, and the round goes on: the right
    # update is still accepted. (These used to leave the process waiting for
    # gRPC to let go of chunks the server never read.)
    port = free_port()
    cfg = write_config(tmp_path / "c.yaml", port, rounds=1)
    server = subprocess.Popen([BIN, "server", cfg, "-q", "--out", str(tmp_path / "server"), "--set",
                               "server_configs.num_clients=1"])
    try:
        client = memfl.Client(f"127.0.0.1:{port}", client_id="0")
        assert client.next_round() == 1
        sd = CNN().state_dict()
        client.receive(sd)
        poisoned = dict(sd)
        poisoned["conv2.weight"] = sd["conv2.weight"].clone()
        poisoned["conv2.weight"].view(-1)[123] = float("nan")
        with pytest.raises(ValueError, match=r"tensor 'conv2\.weight' element 123 is not finite"):
            client.send(poisoned, num_samples=10.0, metrics={})
        for bad in (-1.0, 0.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match=r"sample count"):
                client.send(sd, num_samples=bad, metrics={})
        client.send(sd, num_samples=10.0, metrics={"train_loss": 1.0})
        assert client.next_round() == -1
        client.close()
        assert server.wait(timeout=120) == 0
    finally:
        if server.poll() is None:
            server.kill()

    # A client that asks for a round's model and never reads it ends when it
    # closes (or when the interpreter exits), instead of waiting on a server
    # that is blocked sending it the model. (The server, its only client gone,
    # ends the run: each ending gets a server of its own.)
    for i, ending in enumerate(("client.close()", "pass")):
        port = free_port()
        cfg = write_config(tmp_path / f"d{i}.yaml", port, rounds=1)
        server = subprocess.Popen([BIN, "server", cfg, "-q", "--out", str(tmp_path / f"server{i}"), "--set",
                                   "server_configs.num_clients=1"])
        try:
            code = ("import memfl\n"
                    f"client = memfl.Client('127.0.0.1:{port}', client_id='0')\n"
                    "assert client.next_round() >= 1\n" + ending + "\n")
            r = subprocess.run([sys.executable, "-c", code], timeout=60, env=os.environ.copy())
            assert r.returncode == 0, ending
        finally:
            server.kill()
            server.wait()


def play_dummy_trainer(port, client_id, scale):
    """DummyTrainer's update, written here in torch from its documented formula
    (client c in round r adds s·(c+1)·(1 + (i + r) mod 5) to element i of each
    tensor, in f32, and weighs 5·(c+1)): what a C++ client on the same model sends."""
    client = memfl.Client(f"127.0.0.1:{port}", client_id=str(client_id))
    sd = {name: torch.zeros(shape, dtype=torch.float32) for name, _, shape in client.layout}
    rounds = 0
    while (r := client.next_round()) >= 0:
        client.receive(sd)
        for t in sd.values():
            i = torch.arange(t.numel(), dtype=torch.float64)
            d = (scale * (client_id + 1) * (1 + torch.remainder(i + r, 5))).to(torch.float32)
            t.view(-1).add_(d)
        client.send(sd, 5.0 * (client_id + 1), {})
        rounds += 1
    client.close()
    return rounds


@pytest.mark.parametrize("channel", ["grpc", "tcp"])
def test_the_python_client_path_gives_the_cpp_clients_model_bit_for_bit(tmp_path, channel):
    # The Python client runs the C++ client's protocol (one gRPC client
    # transport): playing DummyTrainer beside a C++ client, on the stream or
    # the data channel, with chunks that cut tensors, it ends the run on the
    # very bytes two C++ clients end on (the update is computed the same way
    # in f32, so nothing but the transport could differ). A Python client that
    # sent back the model it received, or weighed its update otherwise, would
    # end elsewhere: client 1's change is twice client 0's.
    scale = 0.01
    text = ("client_configs:\n  train_configs:\n    trainer: DummyTrainer\n"
            f"    dummy_update_scale: {scale}\n"
            "  model_configs:\n    model_name: synthetic\n    model_kwargs:\n      num_params: 3000\n"
            "server_configs:\n  num_clients: 2\n  num_global_epochs: 2\n  round_timeout_s: 60\n"
            "  aggregator_kwargs:\n    client_weights_mode: sample_size\n"
            "  comm_configs:\n    grpc_configs:\n      server_uri: 127.0.0.1:PORT\n      model_chunk_size: 1000\n"
            f"      data_channel: {channel}\n")
    port = free_port()
    cfg = tmp_path / "mixed.yaml"
    cfg.write_text(text.replace("PORT", str(port)))
    server = subprocess.Popen([BIN, "server", str(cfg), "-q", "--out", str(tmp_path / "mixed")])
    cpp = subprocess.Popen([BIN, "client", str(cfg), "--client-id", "0", "-q", "--out", str(tmp_path / "c0")])
    try:
        assert play_dummy_trainer(port, 1, scale) == 2
        assert cpp.wait(timeout=120) == 0
        assert server.wait(timeout=120) == 0
    finally:
        for p in (server, cpp):
            if p.poll() is None:
                p.kill()
    ref_cfg = tmp_path / "cpp.yaml"
    ref_cfg.write_text(text.replace("PORT", "0"))
    r = subprocess.run([BIN, "launch", str(ref_cfg), "--clients", "2", "-q", "--out", str(tmp_path / "cpp")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    mixed = read_safetensors(tmp_path / "mixed/global_model.safetensors")
    cpp_only = read_safetensors(tmp_path / "cpp/server/global_model.safetensors")
    assert sorted(mixed) == sorted(cpp_only)
    for k in mixed:
        assert torch.equal(mixed[k], cpp_only[k]), k


@pytest.mark.parametrize("alias", [" 1", "+1", "01", "1 ", "-0", "", "1e0", "4294967296"])
def test_a_client_id_the_server_would_refuse_is_refused_before_connecting(alias):
    # The server's own parser: no spelling of an id reaches the wire that the
    # server would read as another (or refuse). Port 1 has no server, so a
    # check made after connecting would fail with another message.
    with pytest.raises(ValueError, match="a client id is a number from 0"):
        memfl.Client("127.0.0.1:1", client_id=alias)
