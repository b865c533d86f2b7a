// tally.utils.data (torch.utils.data): the datasets of tally::data (synthetic images and
// tokens, MNIST, Fashion-MNIST, CIFAR-10, the byte-level text corpus) and the DataLoader,
// iterated from Python as (input, target) pairs. The loader's worker is a C++ thread that
// never touches Python, so datasets are Tally's own; a batch is waited for with the GIL
// released.
#include <pybind11/stl.h>

#include "common.h"
#include "nn/data/cifar.h"
#include "nn/data/dataloader.h"
#include "nn/data/mnist.h"
#include "nn/data/synthetic.h"
#include "nn/data/text.h"

namespace tally::python {

namespace {

using data::DataLoader;
using data::Dataset;
using data::Example;

py::tuple pair(const Example& e) {
  return py::make_tuple(e.input, e.target);
}

data::Split to_split(const std::string& s) {
  if (s == "train") return data::Split::train;
  if (s == "val") return data::Split::val;
  throw py::value_error("split must be 'train' or 'val', got '" + s + "'");
}

Shape to_shape(const std::vector<int64_t>& v) {
  return Shape(v.begin(), v.end());
}

// One epoch of a DataLoader as a Python iterator: DataLoader::begin() starts the epoch.
class LoaderIterator {
 public:
  explicit LoaderIterator(DataLoader& loader) : loader_(loader) {}
  py::tuple next() {
    Example batch;
    {
      py::gil_scoped_release release;  // the worker may still be assembling the batch
      if (!it_) {
        it_.emplace(loader_.begin());
      } else if (!(*it_ == DataLoader::Sentinel{})) {
        ++*it_;
      }
      if (*it_ == DataLoader::Sentinel{}) {
        done_ = true;
      } else {
        batch = **it_;
      }
    }
    if (done_) throw py::stop_iteration();
    return pair(batch);
  }

 private:
  DataLoader& loader_;
  std::optional<DataLoader::Iterator> it_;
  bool done_ = false;
};

}  // namespace

void bind_data(py::module_& m) {
  // torch.Generator and torch.randperm: the shuffling DataLoader's (python/tally/_data.py).
  py::class_<Generator>(m, "Generator",
                        "torch.Generator: a Philox random generator of its own, seeded with "
                        "manual_seed (the CPU's; the device argument is accepted for 'cpu')")
      .def(py::init([](py::object device) {
             if (!device.is_none() && to_device(device).type != DeviceType::cpu)
               throw py::value_error(
                   "Generator: only device='cpu' is supported (it seeds "
                   "Tally's host-side shuffles and permutations)");
             return std::make_unique<Generator>();
           }),
           py::arg("device") = py::none())
      .def(
          "manual_seed",
          [](Generator& g, uint64_t seed) -> Generator& {
            g.manual_seed(seed);
            return g;
          },
          py::arg("seed"), py::return_value_policy::reference_internal)
      .def("initial_seed", [](const Generator& g) { return g.state().seed; });
  m.def(
      "randperm",
      [](int64_t n, Generator* generator, py::object dtype, py::object device) {
        if (n < 0)
          throw py::value_error("randperm: n must be non-negative, got " + std::to_string(n));
        // The tensor first: an n past the allocator's limit is its out-of-memory error, before
        // the permutation is built in host memory the allocator does not see.
        Tensor t = ops::empty({n}, DType::int64);
        const std::vector<int64_t> perm =
            data::randperm(n, generator ? *generator : default_generator());
        std::copy(perm.begin(), perm.end(), t.data<int64_t>());
        if (!dtype.is_none()) t = ops::to(t, to_dtype(dtype));
        return device.is_none() ? t : t.to(to_device(device));
      },
      py::arg("n"), py::kw_only(), py::arg("generator") = nullptr, py::arg("dtype") = py::none(),
      py::arg("device") = py::none(),
      "torch.randperm: a uniform random permutation of [0, n) drawn from `generator` (the "
      "default generator when None)");

  m.def(
      "_randint_generator",
      [](int64_t low, int64_t high, int64_t n, Generator* generator) {
        return ops::randint(low, high, {n}, DType::int64, Device::cpu(),
                            generator ? generator : &default_generator());
      },
      py::arg("low"), py::arg("high"), py::arg("n"), py::arg("generator").none(true),
      "n int64 values uniform in [low, high) from `generator` (None: the default one)");

  py::module_ utils = m.attr("utils").cast<py::module_>();
  py::module_ d = utils.def_submodule(
      "data", "torch.utils.data: Tally's datasets and the DataLoader (a C++ worker thread)");

  py::class_<Dataset>(d, "Dataset",
                      "A random-access collection of (input, target) examples. Datasets are "
                      "Tally's own (the loader's worker runs without Python)")
      .def("__len__", &Dataset::size)
      .def(
          "__getitem__",
          [](const Dataset& ds, int64_t i) {
            if (i < 0) i += ds.size();
            return pair(ds.get(i));
          },
          py::arg("index"))
      .def(
          "get_batch",
          [](const Dataset& ds, const std::vector<int64_t>& indices) {
            return pair(ds.get_batch(indices));
          },
          py::arg("indices"), "The examples at `indices` stacked along a new first dimension");

  py::class_<data::SyntheticImages, Dataset>(d, "SyntheticImages")
      .def(py::init(
               [](int64_t n, const std::vector<int64_t>& shape, int64_t classes, uint64_t seed) {
                 return std::make_unique<data::SyntheticImages>(n, to_shape(shape), classes, seed);
               }),
           py::arg("n"), py::arg("shape"), py::arg("classes"), py::arg("seed") = 0,
           "n float32 images of `shape` with labels in [0, classes): a per-class pattern plus "
           "noise, the same for the same (seed, index)")
      .def("label", &data::SyntheticImages::label, py::arg("index"));
  py::class_<data::SyntheticTokens, Dataset>(d, "SyntheticTokens")
      .def(py::init([](int64_t n, int64_t vocab, const std::vector<int64_t>& shape, uint64_t seed) {
             return std::make_unique<data::SyntheticTokens>(n, vocab, to_shape(shape), seed);
           }),
           py::arg("n"), py::arg("vocab"), py::arg("shape"), py::arg("seed") = 0,
           "n int64 token sequences of `shape`; the target is the sequence one token later");
  py::class_<data::MNIST, Dataset>(d, "MNIST")
      .def(py::init<const std::string&, bool, double, double>(), py::arg("root"),
           py::arg("train") = true, py::arg("mean") = 0.1307, py::arg("std") = 0.3081,
           "MNIST's IDX files ({train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]) in `root`")
      .def_property_readonly("labels", &data::MNIST::labels);
  py::class_<data::FashionMNIST, data::MNIST>(d, "FashionMNIST")
      .def(py::init<const std::string&, bool, double, double>(),
           py::arg("root") = data::FashionMNIST::kDefaultRoot, py::arg("train") = true,
           py::arg("mean") = 0.2860, py::arg("std") = 0.3530,
           "Fashion-MNIST (Debian's dataset-fashion-mnist by default)");
  py::class_<data::CIFAR10, Dataset>(d, "CIFAR10")
      .def(py::init<const std::string&, bool, std::array<double, 3>, std::array<double, 3>>(),
           py::arg("root"), py::arg("train") = true, py::arg("mean") = data::CIFAR10::kMean,
           py::arg("std") = data::CIFAR10::kStd,
           "CIFAR-10's binary batches (cifar-10-batches-bin) in `root`")
      .def_property_readonly("labels", &data::CIFAR10::labels);
  py::class_<data::TextWindows, Dataset>(d, "TextWindows")
      .def_property_readonly("seq_len", &data::TextWindows::seq_len);
  py::class_<data::TextCorpus>(d, "TextCorpus",
                               "A byte-level text corpus (a token is a byte, vocabulary 256), "
                               "split into train and the last val_fraction")
      .def(py::init<const std::string&, double>(), py::arg("path") = data::TextCorpus::kDefaultPath,
           py::arg("val_fraction") = 0.1)
      .def_property_readonly("vocab_size", &data::TextCorpus::vocab_size)
      .def_property_readonly("path", &data::TextCorpus::path)
      .def(
          "num_tokens",
          [](const data::TextCorpus& c, std::optional<std::string> split) {
            return split ? c.num_tokens(to_split(*split)) : c.num_tokens();
          },
          py::arg("split") = py::none())
      .def(
          "tokens",
          [](const data::TextCorpus& c, const std::string& s) { return c.tokens(to_split(s)); },
          py::arg("split") = "train")
      .def(
          "get_batch",
          [](const data::TextCorpus& c, int64_t batch, int64_t seq_len, uint64_t seed,
             const std::string& split) {
            Generator gen(seed);
            return pair(c.get_batch(batch, seq_len, gen, to_split(split)));
          },
          py::arg("batch"), py::arg("seq_len"), py::arg("seed") = 0, py::arg("split") = "train",
          "`batch` random windows (x, y) of the split, drawn from a generator seeded with `seed`")
      .def(
          "windows",
          [](const data::TextCorpus& c, const std::string& s, int64_t seq_len) {
            return c.windows(to_split(s), seq_len);
          },
          py::arg("split"), py::arg("seq_len"),
          "The split's non-overlapping windows of seq_len tokens, as a Dataset")
      .def_static("encode", &data::TextCorpus::encode, py::arg("text"))
      .def_static(
          "decode",
          [](const Tensor& tokens) { return py::bytes(data::TextCorpus::decode(tokens)); },
          py::arg("tokens"), "The bytes of int64 tokens");

  py::class_<LoaderIterator>(d, "_LoaderIterator")
      .def("__iter__", [](LoaderIterator& it) -> LoaderIterator& { return it; })
      .def("__next__", &LoaderIterator::next);

  py::class_<DataLoader>(d, "DataLoader",
                         "Batches of a Dataset, shuffled per epoch from `seed`, assembled ahead "
                         "by a worker thread; each iteration is one epoch of (input, target)")
      .def(py::init([](const Dataset& ds, int64_t batch_size, bool shuffle, uint64_t seed,
                       bool drop_last, py::object device, bool pin_memory, int64_t prefetch) {
             data::DataLoaderOptions o;
             o.batch_size = batch_size;
             o.shuffle = shuffle;
             o.seed = seed;
             o.drop_last = drop_last;
             o.device = device.is_none() ? Device::cpu() : to_device(device);
             o.pin_memory = pin_memory;
             o.prefetch = prefetch;
             return std::make_unique<DataLoader>(ds, o);
           }),
           py::arg("dataset"), py::arg("batch_size") = 1, py::arg("shuffle") = false,
           py::arg("seed") = 0, py::arg("drop_last") = false, py::arg("device") = py::none(),
           py::arg("pin_memory") = true, py::arg("prefetch") = 2,
           py::keep_alive<1, 2>())  // the loader reads the dataset from its worker
      .def("__len__", &DataLoader::len)
      .def(
          "__iter__", [](DataLoader& l) { return LoaderIterator(l); }, py::keep_alive<0, 1>())
      .def_property("epoch", &DataLoader::epoch, &DataLoader::set_epoch)
      .def("epoch_order", &DataLoader::epoch_order, py::arg("epoch"))
      .def_property_readonly("pinned", &DataLoader::pinned)
      .def(
          "stop",
          [](DataLoader& l) {
            py::gil_scoped_release release;
            l.stop();
          },
          "Stops the worker and frees the batches it assembled");
}

}  // namespace tally::python
