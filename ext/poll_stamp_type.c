/*
 * poll_stamp_type.c -- when the drop-in loop's last poll returned.  A
 * PollStamp wraps the loop's selector: its select() calls the wrapped one
 * and then reads the core's clock into polled_ns, which the loop's port
 * drain takes as its bound (Port.drain(until), port_type.c; why, in
 * docs/design.rst, "Order on the loop").  loop.py subclasses it with the
 * rest of the selector API, which is called far less often.  It is C
 * because select() runs once per loop iteration, timers or not: in Python
 * the wrapper cost an idle iteration about 6% of its time.
 */
#include "module.h"

typedef struct {
    PyObject_HEAD
    PyObject *selector;
    PyObject *select;  /* selector.select, bound when made */
    long long polled_ns; /* -1 before the first select() returns */
} PollStampObject;
#define POLLSTAMP_REFS(X) X(selector) X(select)

EXT_GC_TRAVERSE(PollStamp, PollStampObject, POLLSTAMP_REFS)
EXT_GC_CLEAR(PollStamp, PollStampObject, POLLSTAMP_REFS)

static void PollStamp_dealloc(PollStampObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    PollStamp_clear(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *PollStamp_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *selector;
    if (kwargs && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "PollStamp() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O:PollStamp", &selector)) return NULL;
    PyObject *select = PyObject_GetAttrString(selector, "select");
    if (!select) return NULL;
    if (!PyCallable_Check(select)) {
        Py_DECREF(select);
        return PyErr_Format(PyExc_TypeError, "selector.select must be callable, not %.100s",
                            Py_TYPE(select)->tp_name);
    }
    PollStampObject *self = (PollStampObject *)type->tp_alloc(type, 0);
    if (!self) {
        Py_DECREF(select);
        return NULL;
    }
    self->selector = Py_NewRef(selector);
    self->select = select;
    self->polled_ns = -1;
    return (PyObject *)self;
}

/* select(timeout=None): the wrapped selector's answer, passed through; the
 * time is noted only when it returns one (an exception leaves the last). */
static PyObject *PollStamp_select(PollStampObject *self, PyObject *const *args, size_t nargsf,
                                  PyObject *kwnames) {
    PyObject *select = self->select;
    if (!select) {
        PyErr_SetString(PyExc_RuntimeError, "PollStamp has no selector (cleared)");
        return NULL;
    }
    /* the wrapped select runs Python, which could reach tp_clear */
    Py_INCREF(select);
    PyObject *ready = PyObject_Vectorcall(select, args, PyVectorcall_NARGS(nargsf), kwnames);
    Py_DECREF(select);
    if (ready) self->polled_ns = (long long)bt_now_ns();
    return ready;
}

static PyMethodDef PollStamp_methods[] = {
    {"select", (PyCFunction)(void (*)(void))PollStamp_select, METH_FASTCALL | METH_KEYWORDS,
     "select($self, /, timeout=None)\n--\n\n"
     "The wrapped selector's select(); then notes the time in polled_ns."},
    {NULL}};

static PyMemberDef PollStamp_members[] = {
    {"selector", Py_T_OBJECT_EX, offsetof(PollStampObject, selector), Py_READONLY,
     "The wrapped selector."},
    {"polled_ns", Py_T_LONGLONG, offsetof(PollStampObject, polled_ns), Py_READONLY,
     "When the last select() returned: the core's clock (CLOCK_MONOTONIC) in ns, "
     "-1 before the first."},
    {NULL}};

static PyType_Slot PollStamp_slots[] = {
    {Py_tp_doc, "PollStamp(selector, /)\n--\n\n"
                "A selector's select(), noting when each poll returned."},
    {Py_tp_new, PollStamp_new},
    {Py_tp_dealloc, PollStamp_dealloc},
    {Py_tp_traverse, PollStamp_traverse},
    {Py_tp_clear, PollStamp_clear},
    {Py_tp_methods, PollStamp_methods},
    {Py_tp_members, PollStamp_members},
    {0, NULL}};

PyType_Spec PollStamp_spec = {
    .name = "bucketimer._core.PollStamp",
    .basicsize = sizeof(PollStampObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_BASETYPE,
    .slots = PollStamp_slots,
};
