// EntryWatch: entries of Python dicts as a captured step found them (a module's training flag,
// its constants, children, parameters and buffers), checked before each replay without leaving
// C++.
//
// A captured graph runs the modules, parameters and buffers it was captured with; user code
// that assigns new ones between calls (model.fc = nn.Linear(...), load_state_dict(assign=True),
// model.bn.running_mean = t, model.eval()) changes an entry of a module's dicts, not anything the
// graph reads; one that adds a module, parameter or buffer (Sequential.append, register_buffer)
// adds an entry the graph never reads, which the sizes of the dicts whose keys are closed catch.
// The whole pass costs a few ns an entry (the CIFAR ResNet-18: 566 entries and 253 dicts'
// numbers of keys, about 5 us a call on a 2-core host), so the step checks them all on its fast
// path and leaves naming what changed to Python's slow path. A closure's cell stands in for a
// dict too (its contents, the key ignored): the numbers a loss function reads from the scope it
// was made in; and a class for its own dict (a class attribute set anew: torch's count of the
// hooks ever registered, RemovableHandle.next_id, which a hook registered on a parameter's
// gradient moves). The dicts of hooks a parameter holds appear with its first hook, so the
// dicts whose numbers of keys must stay are set anew (set_sized) besides those closed at
// construction. A list stands in for a dict too, its index for a key: the modules a loss
// function reads through a list it names (each item by identity, the list's length closed).
// And an entry may watch a list value by its items (`items`): a list of numbers a forward reads
// (self.scales = [1.0, 0.5], a global list of loss weights) changes in place, which its
// identity does not show; the entry keeps a copy and compares the items, by identity, and
// their number.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "python/bindings.h"

namespace py = pybind11;

namespace nimble_train {
namespace {

class EntryWatch {
 public:
  // entries: (dict, key, value) triples; value is what dict[key] must be, by identity; or
  // (cell, None, value): what the closure cell must hold; or (class, key, value): what the
  // class's own dict must hold (a class of Python code's; a builtin's dict is not kept there);
  // or (list, index, value): what the list must hold at index (a non-negative int).
  // closed: dicts (or lists) that must keep as many keys (items) as they hold now (those not in
  // entries, too). items: the indices of the entries whose values, when lists, are compared by
  // their items (another list holding the same objects is the same value) from a copy taken
  // now and at each update.
  EntryWatch(const py::list& entries, const py::list& closed, const py::list& items) {
    entries_.reserve(entries.size());
    for (size_t i = 0; i < entries.size(); ++i) {
      const py::handle item = entries[i];
      if (!py::isinstance<py::tuple>(item) || py::len(item) != 3) {
        throw py::type_error("EntryWatch: entry " + std::to_string(i) +
                             " must be a (dict, key, value) tuple; got " +
                             std::string(py::str(py::type::of(item).attr("__name__"))));
      }
      const auto t = py::reinterpret_borrow<py::tuple>(item);
      py::object table = t[0];
      if (PyType_Check(table.ptr()) &&
          PyType_HasFeature(reinterpret_cast<PyTypeObject*>(table.ptr()), Py_TPFLAGS_HEAPTYPE)) {
        table = py::reinterpret_borrow<py::object>(
            reinterpret_cast<PyTypeObject*>(table.ptr())->tp_dict);
      }
      if (!PyDict_Check(table.ptr()) && !PyCell_Check(table.ptr()) && !PyList_Check(table.ptr())) {
        throw py::type_error("EntryWatch: entry " + std::to_string(i) +
                             " must hold a dict, a cell, a list or a class of Python code's "
                             "first; got " +
                             std::string(py::str(py::type::of(t[0]).attr("__name__"))));
      }
      Py_ssize_t index = -1;
      if (PyList_Check(table.ptr())) {
        index = PyLong_Check(t[1].ptr()) ? PyLong_AsSsize_t(t[1].ptr()) : -1;
        if (index < 0) {
          PyErr_Clear();
          throw py::type_error("EntryWatch: entry " + std::to_string(i) +
                               " holds a list, so its key must be an index (an int >= 0); got " +
                               std::string(py::repr(t[1])));
        }
      }
      entries_.push_back({table, t[1], t[2], index, false, py::object()});
    }
    for (const py::handle item : items) {
      const Py_ssize_t i = PyLong_Check(item.ptr()) ? PyLong_AsSsize_t(item.ptr()) : -1;
      if (i < 0 || size_t(i) >= entries_.size()) {
        PyErr_Clear();
        throw py::index_error("EntryWatch: items must hold entry indices in [0, " +
                              std::to_string(entries_.size()) + "); got " +
                              std::string(py::repr(item)));
      }
      Entry& e = entries_[size_t(i)];
      e.by_items = true;
      e.items = copy_if_list(e.value.ptr());
    }
    closed_ = sizes_of(closed, "closed");
  }

  // The index of the first entry from `start` on whose dict no longer holds its value under
  // its key (another object, or none); else size() + k for the first closed dict k whose number
  // of keys changed; else size() + closed dicts + k for the first such dict k of set_sized's;
  // else -1.
  int64_t first_changed(int64_t start) const {
    for (size_t i = first(start); i < entries_.size(); ++i) {
      if (is_changed(entries_[i])) return int64_t(i);
    }
    for (size_t k = 0; k < closed_.size(); ++k) {
      if (size_of(closed_[k].dict) != closed_[k].size) {
        return int64_t(entries_.size() + k);
      }
    }
    for (size_t k = 0; k < sized_.size(); ++k) {
      if (size_of(sized_[k].dict) != sized_[k].size) {
        return int64_t(entries_.size() + closed_.size() + k);
      }
    }
    return -1;
  }

  // Dicts that must keep as many keys as they hold now, in place of those set before.
  void set_sized(const py::list& dicts) { sized_ = sizes_of(dicts, "sized"); }

  // Every closed dict whose number of keys changed, in order.
  std::vector<int64_t> resized() const {
    std::vector<int64_t> out;
    for (size_t k = 0; k < closed_.size(); ++k) {
      if (size_of(closed_[k].dict) != closed_[k].size) out.push_back(int64_t(k));
    }
    return out;
  }

  // Each closed dict's number of keys becomes what it holds now.
  void take_sizes() {
    for (Closed& c : closed_) c.size = size_of(c.dict);
  }

  // Every entry from `start` on that changed, in order.
  std::vector<int64_t> changed(int64_t start) const {
    std::vector<int64_t> out;
    for (size_t i = first(start); i < entries_.size(); ++i) {
      if (is_changed(entries_[i])) out.push_back(int64_t(i));
    }
    return out;
  }

  // Entry i's value becomes what its dict holds now (an equal number in a new object, say).
  void update(int64_t i) {
    Entry& e = at(i);
    PyObject* now = value_now(e);
    if (now == nullptr) {
      throw py::key_error("EntryWatch: entry " + std::to_string(i) + "'s " +
                          (PyCell_Check(e.dict.ptr()) ? std::string("cell is empty")
                           : e.index >= 0 ? "list holds no item " + std::to_string(e.index)
                                          : "dict holds no " + std::string(py::repr(e.key))) +
                          " to update it to");
    }
    e.value = py::reinterpret_borrow<py::object>(now);
    if (e.by_items) e.items = copy_if_list(now);
  }

  // Entry i watches `dict` under its key from now on, holding its value now (the object
  // whose attributes it watched was replaced by another).
  void retarget(int64_t i, const py::dict& dict) {
    Entry& e = at(i);
    if (PyCell_Check(e.dict.ptr()) || e.index >= 0) {
      throw py::type_error("EntryWatch: entry " + std::to_string(i) + " watches a " +
                           (e.index >= 0 ? "list" : "closure cell") + ", not a dict");
    }
    Entry moved{dict, e.key, py::none(), -1, e.by_items, py::object()};
    PyObject* now = value_now(moved);
    if (now == nullptr) {
      throw py::key_error("EntryWatch: the dict entry " + std::to_string(i) +
                          " is to watch holds no " + std::string(py::repr(e.key)));
    }
    moved.value = py::reinterpret_borrow<py::object>(now);
    if (moved.by_items) moved.items = copy_if_list(now);
    e = std::move(moved);
  }

  size_t size() const { return entries_.size(); }

 private:
  size_t first(int64_t start) const {
    if (start < 0 || size_t(start) > entries_.size()) {
      throw py::index_error("EntryWatch: start must be in [0, " + std::to_string(entries_.size()) +
                            "]; got " + std::to_string(start));
    }
    return size_t(start);
  }

  struct Entry {
    py::object dict;
    py::object key;
    py::object value;  // kept alive: identity is what is compared
    Py_ssize_t index;  // a list's: the index the key names; else -1
    bool by_items;     // a list value is compared by its items
    py::object items;  // by_items and the value a list: a copy of it; else null
  };

  // Whether entry e's dict no longer holds its value: another object, or none; for a list
  // watched by its items, anything but a list holding the same objects.
  static bool is_changed(const Entry& e) {
    PyObject* now = value_now(e);
    if (!e.items) return now != e.value.ptr();
    if (now == nullptr || !PyList_Check(now)) return true;
    const Py_ssize_t n = PyList_GET_SIZE(e.items.ptr());
    if (PyList_GET_SIZE(now) != n) return true;
    for (Py_ssize_t k = 0; k < n; ++k) {
      if (PyList_GET_ITEM(now, k) != PyList_GET_ITEM(e.items.ptr(), k)) return true;
    }
    return false;
  }

  // A copy of a list (its items, by reference); null for anything else.
  static py::object copy_if_list(PyObject* value) {
    if (value == nullptr || !PyList_Check(value)) return py::object();
    PyObject* copy = PyList_GetSlice(value, 0, PyList_GET_SIZE(value));
    if (copy == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(copy);
  }

  Entry& at(int64_t i) {
    if (i < 0 || size_t(i) >= entries_.size()) {
      throw py::index_error("EntryWatch: no entry " + std::to_string(i) + " of " +
                            std::to_string(entries_.size()));
    }
    return entries_[size_t(i)];
  }

  // What the entry's dict holds under its key, its cell holds, or its list at its index
  // (borrowed; nullptr: none).
  static PyObject* value_now(const Entry& e) {
    if (PyCell_Check(e.dict.ptr())) return PyCell_GET(e.dict.ptr());
    if (e.index >= 0) {
      return e.index < PyList_GET_SIZE(e.dict.ptr()) ? PyList_GET_ITEM(e.dict.ptr(), e.index)
                                                     : nullptr;
    }
    PyObject* now = PyDict_GetItemWithError(e.dict.ptr(), e.key.ptr());
    if (now == nullptr && PyErr_Occurred()) throw py::error_already_set();
    return now;
  }

  struct Closed {
    py::object dict;
    Py_ssize_t size;
  };

  // A closed dict's number of keys, or a list's of items.
  static Py_ssize_t size_of(const py::object& table) {
    return PyList_Check(table.ptr()) ? PyList_GET_SIZE(table.ptr()) : PyDict_Size(table.ptr());
  }

  static std::vector<Closed> sizes_of(const py::list& dicts, const char* what) {
    std::vector<Closed> out;
    out.reserve(dicts.size());
    for (size_t i = 0; i < dicts.size(); ++i) {
      const py::handle d = dicts[i];
      if (!PyDict_Check(d.ptr()) && !PyList_Check(d.ptr())) {
        throw py::type_error("EntryWatch: " + std::string(what) + " dict " + std::to_string(i) +
                             " must be a dict or a list; got " +
                             std::string(py::str(py::type::of(d).attr("__name__"))));
      }
      const auto table = py::reinterpret_borrow<py::object>(d);
      out.push_back({table, size_of(table)});
    }
    return out;
  }

  std::vector<Entry> entries_;
  std::vector<Closed> closed_;
  std::vector<Closed> sized_;  // set_sized's
};

}  // namespace

void bind_watch(py::module_& m) {
  py::class_<EntryWatch>(m, "EntryWatch",
                         "Entries of Python dicts as they were: (dict, key, value) triples, "
                         "each compared by identity ((cell, None, value): a closure cell's "
                         "contents; (class, key, value): the class's own dict's; (list, index, "
                         "value): a list's item), a list value of the entries in items by its "
                         "items, and the numbers of keys of closed dicts (or items of closed "
                         "lists) and of set_sized's.")
      .def(py::init<const py::list&, const py::list&, const py::list&>(), py::arg("entries"),
           py::arg("closed") = py::list(), py::arg("items") = py::list())
      .def("first_changed", &EntryWatch::first_changed, py::arg("start") = 0,
           "The index of the first entry from start on whose dict no longer holds its value; "
           "else len(self) + k for the first closed dict k with another number of keys; else "
           "len(self) + len(closed) + k for the first such dict k of set_sized's; else -1.")
      .def("set_sized", &EntryWatch::set_sized, py::arg("dicts"),
           "Dicts that must keep as many keys as they hold now, in place of those set before.")
      .def("resized", &EntryWatch::resized,
           "Every closed dict (its index in closed) with another number of keys, in order.")
      .def("take_sizes", &EntryWatch::take_sizes,
           "Each closed dict's number of keys becomes what it holds now.")
      .def("changed", &EntryWatch::changed, py::arg("start") = 0,
           "Every entry from start on that changed, in order.")
      .def("update", &EntryWatch::update, py::arg("i"),
           "Entry i's value becomes what its dict holds now.")
      .def("retarget", &EntryWatch::retarget, py::arg("i"), py::arg("dict"),
           "Entry i watches dict under its key from now on, holding its value now.")
      .def("__len__", &EntryWatch::size);
}

}  // namespace nimble_train
