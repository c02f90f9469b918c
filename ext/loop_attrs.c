/*
 * loop_attrs.c -- the drop-in loop's __setattr__ and __delattr__.  They
 * store as object's do, then, when the name is "time" (a clock set on or
 * deleted from the instance), call the loop's _bt_clock_changed(), which
 * moves its timers to the stock path or back (bucketimer/loop.py).
 * asyncio's loop sets some 30 attributes in its life, most in __init__; as
 * Python methods these cost each a call, about a quarter of what the
 * drop-in loop added to a loop's life (docs/performance.rst, "A
 * short-lived loop").  They are method descriptors of object in the
 * mixin's class dict, not a C type's tp_setattro: CPython's
 * object.__setattr__ refuses an instance whose class has a C setattro of
 * its own, and it must work on a drop-in loop as on the stock one.
 */
#include "module.h"

/* 1 if `name` is the str "time" (compared by its text: a str subclass's
 * own __eq__ is not asked). */
static int is_time(PyObject *name) {
    return PyUnicode_Check(name) && PyUnicode_GET_LENGTH(name) == 4 &&
           PyUnicode_CompareWithASCIIString(name, "time") == 0;
}

/* self[name] = value (NULL: deleted), then the hook for "time".  The store
 * may run Python code (a descriptor's __set__, a str subclass's __eq__), so
 * name is held, not borrowed, until it has been read. */
static PyObject *store(PyObject *self, PyObject *name, PyObject *value) {
    Py_INCREF(name);
    int time = 0;
    if (PyObject_GenericSetAttr(self, name, value) == 0) time = is_time(name);
    else time = -1;
    Py_DECREF(name);
    if (time < 0) return NULL;
    if (!time) Py_RETURN_NONE;
    return PyObject_CallMethod(self, "_bt_clock_changed", NULL);
}

static PyObject *loop_setattr(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "__setattr__ expected 2 arguments, got %zd", nargs);
        return NULL;
    }
    return store(self, args[0], args[1]);
}

static PyObject *loop_delattr(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1) {
        PyErr_Format(PyExc_TypeError, "__delattr__ expected 1 argument, got %zd", nargs);
        return NULL;
    }
    return store(self, args[0], NULL);
}

static PyMethodDef loop_attr_methods[] = {
    {"__setattr__", (PyCFunction)(void (*)(void))loop_setattr, METH_FASTCALL,
     "__setattr__($self, name, value, /)\n--\n\nobject's; then, for `time`, "
     "self._bt_clock_changed()."},
    {"__delattr__", (PyCFunction)(void (*)(void))loop_delattr, METH_FASTCALL,
     "__delattr__($self, name, /)\n--\n\nobject's; then, for `time`, "
     "self._bt_clock_changed()."},
    {NULL}};

int ext_add_loop_attrs(PyObject *m) {
    static const char *names[] = {"_loop_setattr", "_loop_delattr"};
    for (int i = 0; i < 2; i++) {
        PyObject *d = PyDescr_NewMethod(&PyBaseObject_Type, &loop_attr_methods[i]);
        if (!d) return -1;
        int rc = PyModule_AddObjectRef(m, names[i], d);
        Py_DECREF(d);
        if (rc < 0) return -1;
    }
    return 0;
}
