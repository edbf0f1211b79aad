// `import memfl`: a Python client for `memfl server`, over the
// same gRPC protocol and chunk checks as the C++ client
// (comm/grpc/client_session.h). The model's bytes go straight between the
// wire and the storage of the caller's tensors (a PyTorch state_dict, or
// NumPy arrays): no copy of the model is made here, only one chunk at a time.
//
//   import memfl
//   client = memfl.Client("127.0.0.1:50051", client_id="0", token="…")
//   for rnd in client.rounds():
//       client.receive(model.state_dict())
//       n = train(model)
//       client.send(model.state_dict(), num_samples=n, metrics={"train_loss": loss})
//
// It does not link libtorch: a tensor is read through its Python attributes
// (data_ptr, numel, element_size, dtype, shape, device, is_contiguous).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/grpc/client_session.h"

namespace py = pybind11;

namespace {

using memfl::Status;
using memfl::StatusCode;
using memfl::TensorBuffer;

[[noreturn]] void raise(const Status& s) {
  if (s.code() == StatusCode::kInvalidArgument) throw py::value_error(s.message());
  if (s.code() == StatusCode::kUnavailable) throw std::runtime_error("unavailable: " + s.message());
  throw std::runtime_error(s.to_string());
}

// torch dtypes (str(t.dtype)) and NumPy format characters → memfl's names.
std::string torch_dtype(const std::string& d) {
  static const std::map<std::string, std::string> names = {{"torch.float32", "f32"}, {"torch.bfloat16", "bf16"},
                                                           {"torch.float16", "f16"}, {"torch.int64", "i64"},
                                                           {"torch.int32", "i32"},   {"torch.uint8", "u8"}};
  auto it = names.find(d);
  return it == names.end() ? d : it->second;
}
std::string numpy_dtype(const py::buffer_info& info) {
  if (info.format == py::format_descriptor<float>::format()) return "f32";
  if (info.format == "e") return "f16";
  if (info.format == "l" || info.format == "q") return info.itemsize == 8 ? "i64" : "i32";
  if (info.format == "i") return "i32";
  if (info.format == "B") return "u8";
  return "numpy:" + info.format;
}

// The tensors of a mapping name → torch.Tensor or NumPy array. The objects
// stay referenced by the caller's dict for the whole call.
std::vector<TensorBuffer> buffers_of(const py::dict& state) {
  std::vector<TensorBuffer> out;
  for (auto item : state) {
    TensorBuffer b;
    b.name = py::str(item.first);
    py::handle t = item.second;
    if (py::hasattr(t, "data_ptr") && py::hasattr(t, "element_size")) {
      if (std::string(py::str(t.attr("device").attr("type"))) != "cpu") {
        throw py::value_error("tensor '" + b.name + "' is on " + std::string(py::str(t.attr("device"))) +
                              ": receive into and send from CPU tensors");
      }
      if (!t.attr("is_contiguous")().cast<bool>()) {
        throw py::value_error("tensor '" + b.name + "' is not contiguous");
      }
      b.data = reinterpret_cast<std::byte*>(t.attr("data_ptr")().cast<uintptr_t>());
      b.nbytes = t.attr("numel")().cast<size_t>() * t.attr("element_size")().cast<size_t>();
      b.dtype = torch_dtype(py::str(t.attr("dtype")));
      for (auto d : t.attr("shape")) b.shape.push_back(d.cast<int64_t>());
    } else if (py::isinstance<py::buffer>(t)) {
      py::buffer_info info = py::reinterpret_borrow<py::buffer>(t).request(/*writable=*/true);
      int64_t expect = info.itemsize;
      for (py::ssize_t i = info.ndim; i-- > 0;) {
        if (info.strides[static_cast<size_t>(i)] != expect) {
          throw py::value_error("array '" + b.name + "' is not C-contiguous");
        }
        expect *= info.shape[static_cast<size_t>(i)];
      }
      b.data = static_cast<std::byte*>(info.ptr);
      b.nbytes = static_cast<size_t>(info.size * info.itemsize);
      b.dtype = numpy_dtype(info);
      for (auto d : info.shape) b.shape.push_back(d);
    } else {
      throw py::value_error("'" + b.name + "' is neither a torch.Tensor nor an array");
    }
    out.push_back(std::move(b));
  }
  return out;
}

class Client {
 public:
  Client(const std::string& server_uri, const std::string& client_id, const std::string& token,
         const std::string& root_cert, int connect_timeout_s) {
    memfl::SessionOptions o;
    o.server_uri = server_uri;
    o.client_id = client_id;
    o.token = token;
    o.root_cert = root_cert;
    o.connect_timeout_s = connect_timeout_s;
    memfl::StatusOr<std::unique_ptr<memfl::GrpcClientSession>> s = [&] {
      py::gil_scoped_release nogil;
      return memfl::GrpcClientSession::connect(o);
    }();
    if (!s.ok()) raise(s.status());
    session_ = std::move(*s);
  }
  std::string config() const { return session_->config_yaml(); }
  py::list layout() const {
    py::list l;
    for (const auto& e : session_->layout().entries()) {
      l.append(py::make_tuple(e.name, std::string(memfl::dtype_name(e.dtype)), py::cast(e.shape)));
    }
    return l;
  }
  int next_round() {
    memfl::StatusOr<int> r = [&] {
      py::gil_scoped_release nogil;
      return session_->next_round();
    }();
    if (!r.ok()) raise(r.status());
    return *r;
  }
  int local_steps() const { return session_->local_steps(); }
  void receive(const py::dict& state) {
    auto buffers = buffers_of(state);
    Status st;
    {
      py::gil_scoped_release nogil;
      st = session_->receive(buffers);
    }
    if (!st.ok()) raise(st);
  }
  void send(const py::dict& state, double num_samples, const std::map<std::string, double>& metrics) {
    auto buffers = buffers_of(state);
    Status st;
    {
      py::gil_scoped_release nogil;
      st = session_->send(buffers, num_samples, metrics);
    }
    if (!st.ok()) raise(st);
  }
  void close() {
    py::gil_scoped_release nogil;
    (void)session_->close();
  }

 private:
  std::unique_ptr<memfl::GrpcClientSession> session_;
};

}  // namespace

PYBIND11_MODULE(_memfl, m) {
  m.doc() = "memfl's Python client: talks to `memfl server` over gRPC, into and out of your tensors";
  py::class_<Client>(m, "Client", py::dynamic_attr())
      .def(py::init<const std::string&, const std::string&, const std::string&, const std::string&, int>(),
           py::arg("server_uri") = "127.0.0.1:50051", py::arg("client_id") = "0", py::arg("token") = "",
           py::arg("root_cert") = "", py::arg("connect_timeout_s") = 30,
           "Registers with the server (token, TLS when root_cert names a PEM file) and reads its config and layout.")
      .def_property_readonly("config", &Client::config, "the server's resolved config (YAML)")
      .def_property_readonly("layout", &Client::layout, "[(name, dtype, shape)] of the server's model, in order")
      .def_property_readonly("local_steps", &Client::local_steps, "steps the server asks for this trip (0: config's)")
      .def("next_round", &Client::next_round, "the next round's number, or -1 when the run is over")
      .def("receive", &Client::receive, py::arg("state_dict"),
           "reads the global model into the tensors (checked against the layout by name, shape and dtype)")
      .def("send", &Client::send, py::arg("state_dict"), py::arg("num_samples"),
           py::arg("metrics") = std::map<std::string, double>{}, "uploads the tensors as this round's update")
      .def("close", &Client::close, "says goodbye to the server");
}
