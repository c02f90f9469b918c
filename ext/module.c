/*
 * module.c -- bucketimer._core: module state, exec, traverse, clear.
 */
#include "module.h"

static PyObject *core_set_default_factory(PyObject *m, PyObject *fn) {
    core_state *st = get_state(m);
    Py_XSETREF(st->default_factory, Py_NewRef(fn));
    Py_CLEAR(st->default_tt);
    Py_RETURN_NONE;
}

/* ---- module ------------------------------------------------------------- */

static PyObject *core_monotonic_ns(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLongLong(bt_now_ns());
}

static PyMethodDef core_functions[] = {
    {"monotonic_ns", core_monotonic_ns, METH_NOARGS, "The core's clock, CLOCK_MONOTONIC ns."},
    {"timeout", core_timeout, METH_O,
     "timeout(delay) -> Timeout\n\nasyncio.timeout(delay), with the timer in bucketimer's core."},
    {"timeout_at", core_timeout_at, METH_O,
     "timeout_at(when) -> Timeout\n\nasyncio.timeout_at(when), with the timer in bucketimer's "
     "core."},
    {"_set_default_factory", core_set_default_factory, METH_O, NULL},
#if PY_VERSION_HEX >= 0x030C0000
    {"wait_for", (PyCFunction)(void (*)(void))core_wait_for, METH_FASTCALL | METH_KEYWORDS,
     "wait_for(fut, timeout) -> coroutine\n\nasyncio.wait_for() of 3.12 and later, with the "
     "timer in bucketimer's core."},
    {"_set_wait_for_nonpositive", core_set_wait_for_nonpositive, METH_O, NULL},
#endif
    {NULL}};

static int core_exec(PyObject *m) {
    core_state *st = get_state(m);
    st->Handle_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Handle_spec, NULL);
    if (!st->Handle_Type || PyModule_AddType(m, st->Handle_Type) < 0) return -1;
    st->Port_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Port_spec, NULL);
    if (!st->Port_Type || PyModule_AddType(m, st->Port_Type) < 0) return -1;
    st->TimerThread_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &TimerThread_spec, NULL);
    if (!st->TimerThread_Type || PyModule_AddType(m, st->TimerThread_Type) < 0) return -1;
    PyObject *events = PyImport_ImportModule("asyncio.events");
    if (!events) return -1;
    st->get_running_loop = PyObject_GetAttrString(events, "_get_running_loop");
    Py_DECREF(events);
    if (!st->get_running_loop) return -1;
    st->str_port_for = PyUnicode_InternFromString("_port_for");
    if (!st->str_port_for) return -1;
    running_loop_init();
    st->str_running_loop_key = PyUnicode_InternFromString("__asyncio_running_event_loop__");
    if (!st->str_running_loop_key) return -1;
    st->Scheduler_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Scheduler_spec, NULL);
    if (!st->Scheduler_Type || PyModule_AddType(m, st->Scheduler_Type) < 0) return -1;
    st->Ready_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Ready_spec, NULL);
    if (!st->Ready_Type) return -1;
    st->ready_none = ready_new(st, Py_None);
    if (!st->ready_none) return -1;
    st->Timeout_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Timeout_spec, NULL);
    if (!st->Timeout_Type || PyModule_AddType(m, st->Timeout_Type) < 0) return -1;
    PyObject *tasks = PyImport_ImportModule("asyncio.tasks");
    if (!tasks) return -1;
    st->current_task = PyObject_GetAttrString(tasks, "current_task");
    PyObject *task_type = PyObject_GetAttrString(tasks, "Task");
    if (task_type && PyType_Check(task_type)) {
        st->task_type = (PyTypeObject *)task_type;
        st->task_cancelling = PyObject_GetAttrString(task_type, "cancelling");
        if (!st->task_cancelling) PyErr_Clear();
    } else {
        Py_XDECREF(task_type);
        PyErr_Clear();
    }
    PyObject *ct = PyObject_GetAttrString(tasks, "_current_tasks");
    Py_DECREF(tasks);
    if (!st->current_task) return -1;
    /* 3.11-3.13 keep the loop -> current task map in this dict (the C
     * module's); read it directly if it is one, else ask current_task(). */
    if (ct && PyDict_CheckExact(ct)) st->current_tasks = ct;
    else {
        Py_XDECREF(ct);
        PyErr_Clear();
    }
    PyObject *exc = PyImport_ImportModule("asyncio.exceptions");
    if (!exc) return -1;
    st->CancelledError = PyObject_GetAttrString(exc, "CancelledError");
    Py_DECREF(exc);
    if (!st->CancelledError) return -1;
    st->ExceptionGroup = Py_NewRef(PyExc_Exception);
    PyObject *builtins = PyImport_ImportModule("builtins");
    if (builtins) {
        PyObject *eg = PyObject_GetAttrString(builtins, "ExceptionGroup");
        Py_DECREF(builtins);
        if (eg) Py_SETREF(st->ExceptionGroup, eg);
    }
    PyErr_Clear();
    PyObject *to = PyImport_ImportModule("asyncio.timeouts");
    if (!to) return -1;
    PyObject *tcls = PyObject_GetAttrString(to, "Timeout");
    Py_DECREF(to);
    if (!tcls) return -1;
    /* Present from 3.13: the running asyncio's exit semantics follow it. */
    st->insert_timeout_error = PyObject_GetAttrString(tcls, "_insert_timeout_error");
    Py_DECREF(tcls);
    if (!st->insert_timeout_error) PyErr_Clear();
#define INTERN(field, text)                                 \
    if (!(st->field = PyUnicode_InternFromString(text))) return -1;
    INTERN(str_time, "time");
    INTERN(str_call_soon, "call_soon");
    INTERN(str_cancelling, "cancelling");
    INTERN(str_uncancel, "uncancel");
    INTERN(str_cancel, "cancel");
    INTERN(str_cr_await, "cr_await");
    INTERN(str_close, "close");
    INTERN(str_throw, "throw");
#undef INTERN
#if PY_VERSION_HEX >= 0x030C0000
    st->WaitFor_Type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &WaitFor_spec, NULL);
    if (!st->WaitFor_Type || PyModule_AddType(m, st->WaitFor_Type) < 0) return -1;
    for (PyGetSetDef *g = PyCoro_Type.tp_getset; g && g->name; g++)
        if (strcmp(g->name, "cr_await") == 0 && !g->closure) st->coro_await_getter = g->get;
#endif
    PyObject *base_events = PyImport_ImportModule("asyncio.base_events");
    if (!base_events) return -1;
    PyObject *bel = PyObject_GetAttrString(base_events, "BaseEventLoop");
    Py_DECREF(base_events);
    if (!bel) return -1;
    st->stock_time = PyObject_GetAttr(bel, st->str_time);
    Py_DECREF(bel);
    if (!st->stock_time) return -1;
    if (PyModule_AddIntConstant(m, "CANCELLED", BT_CANCELLED) < 0) return -1;
    if (PyModule_AddIntConstant(m, "TOO_LATE", BT_TOO_LATE) < 0) return -1;
    if (PyModule_AddIntConstant(m, "UNKNOWN", BT_UNKNOWN) < 0) return -1;
    return 0;
}

static int core_traverse(PyObject *m, visitproc visit, void *arg) {
    core_state *st = get_state(m);
    Py_VISIT(st->TimerThread_Type);
    Py_VISIT(st->Handle_Type);
    Py_VISIT(st->Port_Type);
    Py_VISIT(st->get_running_loop);
    Py_VISIT(st->Scheduler_Type);
    Py_VISIT(st->Timeout_Type);
    Py_VISIT(st->Ready_Type);
    Py_VISIT(st->ready_none);
    Py_VISIT(st->stop_iteration);
    Py_VISIT(st->WaitFor_Type);
    Py_VISIT(st->wait_for_nonpositive);
    Py_VISIT(st->task_type);
    Py_VISIT(st->task_cancelling);
    Py_VISIT(st->current_tasks);
    Py_VISIT(st->current_task);
    Py_VISIT(st->CancelledError);
    Py_VISIT(st->ExceptionGroup);
    Py_VISIT(st->insert_timeout_error);
    Py_VISIT(st->default_factory);
    Py_VISIT(st->default_tt);
    Py_VISIT(st->stock_time);
    return 0;
}

static int core_clear(PyObject *m) {
    core_state *st = get_state(m);
    Py_CLEAR(st->TimerThread_Type);
    Py_CLEAR(st->Handle_Type);
    Py_CLEAR(st->Port_Type);
    Py_CLEAR(st->get_running_loop);
    Py_CLEAR(st->str_port_for);
    Py_CLEAR(st->Scheduler_Type);
    Py_CLEAR(st->Timeout_Type);
    Py_CLEAR(st->Ready_Type);
    Py_CLEAR(st->ready_none);
    if (st->ready_spare) {
        PyObject_Free(st->ready_spare);
        st->ready_spare = NULL;
    }
    Py_CLEAR(st->stop_iteration);
    while (st->timeout_nfree > 0) PyObject_GC_Del(st->timeout_free[--st->timeout_nfree]);
    Py_CLEAR(st->WaitFor_Type);
    Py_CLEAR(st->wait_for_nonpositive);
    Py_CLEAR(st->task_type);
    Py_CLEAR(st->task_cancelling);
    Py_CLEAR(st->str_cr_await);
    Py_CLEAR(st->str_close);
    Py_CLEAR(st->str_throw);
    Py_CLEAR(st->current_tasks);
    Py_CLEAR(st->current_task);
    Py_CLEAR(st->CancelledError);
    Py_CLEAR(st->ExceptionGroup);
    Py_CLEAR(st->insert_timeout_error);
    Py_CLEAR(st->default_factory);
    Py_CLEAR(st->default_tt);
    Py_CLEAR(st->str_time);
    Py_CLEAR(st->str_call_soon);
    Py_CLEAR(st->str_cancelling);
    Py_CLEAR(st->str_uncancel);
    Py_CLEAR(st->str_cancel);
    Py_CLEAR(st->stock_time);
    Py_CLEAR(st->str_running_loop_key);
#if PY_VERSION_HEX < 0x030C0000
    Py_CLEAR(st->holder_type);
#endif
    return 0;
}

static void core_free(void *m) { core_clear((PyObject *)m); }

/* No Py_mod_gil slot: a free-threaded CPython re-enables the GIL when it
 * imports this module (and says so).  The per-object paths are written for
 * it (atomic handle states, the free lists compiled out), but the module
 * state's caches (the default TimerThread, the loop-type time check) are
 * updated without a lock, and no free-threaded build exists here to test
 * a claim that they need none. */
static PyModuleDef_Slot core_slots[] = {
    {Py_mod_exec, core_exec},
    {0, NULL}};

struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "bucketimer._core",
    .m_doc = "The CPython module over bucketimer's native timer core.",
    .m_size = sizeof(core_state),
    .m_methods = core_functions,
    .m_slots = core_slots,
    .m_traverse = core_traverse,
    .m_clear = core_clear,
    .m_free = core_free,
};

PyMODINIT_FUNC PyInit__core(void) { return PyModuleDef_Init(&core_module); }
