/*
 * module.c -- bucketimer._core: its functions and constants, and the life of
 * its state (module.h lists the fields): exec fills it, traverse and clear
 * serve the GC, free empties it.  Heap types, multi-phase init, no globals
 * but the module definition.
 *
 * Every file of the module runs with the GIL held (no Py_mod_gil slot: a
 * free-threaded CPython turns the GIL on), and the GIL is what guards the
 * state; the core's own locks are taken only inside bt_* calls, and its
 * timer thread never takes the GIL.  Only timer_thread_type.c lets the GIL go,
 * around the bt_* calls that can block.
 */
#include "module.h"

/* ---- module functions ------------------------------------------------------ */

static PyObject *module_monotonic_ns(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLongLong(bt_now_ns());
}

static PyObject *module_set_default_class(PyObject *m, PyObject *cls) {
    ext_state *st = ext_state_of_module(m);
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, st->TimerThread_Type)) {
        PyErr_SetString(PyExc_TypeError, "the default class must subclass TimerThread");
        return NULL;
    }
    Py_XSETREF(st->default_class, Py_NewRef(cls));
    Py_CLEAR(st->default_tt);
    Py_RETURN_NONE;
}

static PyObject *module_set_armed_hook(PyObject *m, PyObject *hook) {
    ext_state *st = ext_state_of_module(m);
    if (hook != Py_None && !PyCallable_Check(hook)) {
        ext_type_error("hook", "callable or None", hook);
        return NULL;
    }
    Py_XSETREF(st->armed_hook, hook == Py_None ? NULL : Py_NewRef(hook));
    Py_RETURN_NONE;
}

static PyObject *module_default_timer_thread(PyObject *m, PyObject *Py_UNUSED(ignored)) {
    return Py_XNewRef((PyObject *)ext_default_tt(ext_state_of_module(m)));
}

/* gc.callbacks' hook (_timers.py): at the start of a collection. */
static PyObject *module_release_returned(PyObject *m, PyObject *Py_UNUSED(ignored)) {
    ext_release_stop_iteration(&ext_state_of_module(m)->compat);
    Py_RETURN_NONE;
}

static PyObject *module_compat_status(PyObject *m, PyObject *Py_UNUSED(ignored)) {
    return ext_compat_status(&ext_state_of_module(m)->compat);
}

static PyMethodDef module_functions[] = {
    {"monotonic_ns", module_monotonic_ns, METH_NOARGS,
     "monotonic_ns($module, /)\n--\n\nThe core's clock, CLOCK_MONOTONIC ns."},
    {"timeout", (PyCFunction)(void (*)(void))ext_timeout, METH_FASTCALL | METH_KEYWORDS,
     "timeout($module, /, delay)\n--\n\nasyncio.timeout(delay), with the timer in "
     "bucketimer's core."},
    {"timeout_at", (PyCFunction)(void (*)(void))ext_timeout_at, METH_FASTCALL | METH_KEYWORDS,
     "timeout_at($module, /, when)\n--\n\nasyncio.timeout_at(when), with the timer in "
     "bucketimer's core."},
    {"default_timer_thread", module_default_timer_thread, METH_NOARGS,
     "default_timer_thread($module, /)\n--\n\nThe process-wide TimerThread, created on first "
     "use (and anew once closed, or after fork())."},
    {"_set_default_class", module_set_default_class, METH_O, NULL},
    {"_set_signatures", ext_set_signatures, METH_VARARGS,
     "_set_signatures(call_later, call_at)\n"
     "Python functions whose argument errors the module's call_later/call_at raise."},
    {"call_later", (PyCFunction)(void (*)(void))ext_module_call_later,
     METH_FASTCALL | METH_KEYWORDS,
     "call_later($module, delay, callback, /, *args, loop=None, context=None)\n--\n\n"
     "``default_timer_thread().call_later(...)``."},
    {"call_at", (PyCFunction)(void (*)(void))ext_module_call_at, METH_FASTCALL | METH_KEYWORDS,
     "call_at($module, when, callback, /, *args, loop=None, context=None)\n--\n\n"
     "``default_timer_thread().call_at(...)``."},
    {"_set_attach", ext_set_attach, METH_VARARGS,
     "_set_attach(attach_class, stamp_class, report_to_loop, socket, BaseSelector)\n"
     "What connecting a loop's port in C calls and compares with (ext/attach.c)."},
    {"_made_loop", ext_made_loop, METH_NOARGS,
     "_made_loop($module, /)\n--\n\nThe loop whose constructor is connecting its port in "
     "this thread (TimerThread._port_of_made), or None."},
    {"_scheduler", ext_default_scheduler, METH_VARARGS,
     "_scheduler(loop, absolute, /)\n--\n\nThe drop-in loop's call_at (absolute) or call_later, "
     "on the default TimerThread, whichever it is when called."},
    {"_set_armed_hook", module_set_armed_hook, METH_O,
     "_set_armed_hook($module, hook, /)\n--\n\nhook(handle) is called with every Handle "
     "scheduled from now on (None: nothing is; bucketimer.trace_timers)."},
    {"_loop_clock_is_foreign", ext_loop_clock_is_foreign, METH_O,
     "_loop_clock_is_foreign($module, loop, /)\n--\n\nTrue if loop.time() is not a "
     "CLOCK_MONOTONIC clock the core keeps (a virtual clock, a patched time())."},
    {"_add_monotonic_clock", ext_add_monotonic_clock, METH_O,
     "_add_monotonic_clock($module, time, /)\n--\n\nTells the helpers that a loop class "
     "whose `time` is this reads CLOCK_MONOTONIC."},
    {"_release_returned", module_release_returned, METH_NOARGS,
     "_release_returned($module, /)\n--\n\nThe kept StopIteration lets go of the value it last "
     "carried, if nobody holds it (run as a collection starts)."},
    {"_compat_status", module_compat_status, METH_NOARGS,
     "Which reads of CPython's private state are in use (docs/design.rst)."},
#if PY_VERSION_HEX >= 0x030C0000
    {"wait_for", (PyCFunction)(void (*)(void))ext_wait_for, METH_FASTCALL | METH_KEYWORDS,
     "wait_for($module, /, fut, timeout)\n--\n\nasyncio.wait_for() of 3.12 and later, with "
     "the timer in bucketimer's core."},
    {"_set_wait_for_nonpositive", ext_set_wait_for_nonpositive, METH_O, NULL},
#endif
    {NULL}};

/* ---- exec --------------------------------------------------------------------- */

/* st->field = PyType_FromModuleAndSpec(spec), added to the module if `public`. */
static int add_type(PyObject *m, PyTypeObject **field, PyType_Spec *spec, int public) {
    *field = (PyTypeObject *)PyType_FromModuleAndSpec(m, spec, NULL);
    if (!*field) return -1;
    return public ? PyModule_AddType(m, *field) : 0;
}

static int add_types(PyObject *m, ext_state *st) {
    if (add_type(m, &st->Handle_Type, &Handle_spec, 1) < 0 ||
        add_type(m, &st->LoopHandle_Type, &LoopHandle_spec, 1) < 0 ||
        add_type(m, &st->Port_Type, &Port_spec, 1) < 0 ||
        add_type(m, &st->TimerThread_Type, &TimerThread_spec, 1) < 0 ||
        add_type(m, &st->Scheduler_Type, &Scheduler_spec, 1) < 0 ||
        add_type(m, &st->Step_Type, &Step_spec, 0) < 0 ||
        add_type(m, &st->Timeout_Type, &Timeout_spec, 1) < 0 ||
        add_type(m, &st->GrpcCall_Type, &GrpcCall_spec, 1) < 0 ||
        add_type(m, &st->GrpcUnary_Type, &GrpcUnary_spec, 1) < 0 ||
        add_type(m, &st->PollStamp_Type, &PollStamp_spec, 1) < 0)
        return -1;
#if PY_VERSION_HEX >= 0x030C0000
    if (add_type(m, &st->WaitFor_Type, &WaitFor_spec, 1) < 0 ||
        add_type(m, &st->GrpcAioUnary_Type, &GrpcAioUnary_spec, 1) < 0 ||
        add_type(m, &st->GrpcAioCoro_Type, &GrpcAioCoro_spec, 0) < 0)
        return -1;
#endif
    return 0;
}

static int import_asyncio(ext_state *st) {
    PyObject *task_type = ext_import_attr("asyncio.tasks", "Task");
    if (!task_type) return -1;
    if (PyType_Check(task_type)) {
        st->task_type = (PyTypeObject *)task_type;
        st->task_cancelling = PyObject_GetAttrString(task_type, "cancelling");
        if (!st->task_cancelling) PyErr_Clear();
    } else {
        Py_DECREF(task_type);
    }
    PyObject *bel = ext_import_attr("asyncio.base_events", "BaseEventLoop");
    if (!bel) return -1;
    st->stock_time = PyObject_GetAttr(bel, st->str_time);
    Py_DECREF(bel);
    if (!(st->monotonic_clocks = PyList_New(0))) return -1;
    st->CancelledError = ext_import_attr("asyncio.exceptions", "CancelledError");
    st->AbstractEventLoop = ext_import_attr("asyncio.events", "AbstractEventLoop");
    st->ExceptionGroup = ext_import_attr("builtins", "ExceptionGroup");
    return st->stock_time && st->CancelledError && st->AbstractEventLoop && st->ExceptionGroup
               ? 0
               : -1;
}

static int intern_names(ext_state *st) {
#define INTERN(field, text) \
    if (!(st->field = PyUnicode_InternFromString(text))) return -1;
    EXT_STATE_NAMES(INTERN)
#undef INTERN
    return 0;
}

/* The core's constants (bucketimer.h), for the Python side. */
static int add_constants(PyObject *m) {
    static const struct {
        const char *name;
        int value;
    } constants[] = {
        {"CANCELLED", BT_CANCELLED},
        {"TOO_LATE", BT_TOO_LATE},
        {"UNKNOWN", BT_UNKNOWN},
        {"DEFAULT_BUCKETS", BT_DEFAULT_BUCKETS},
        {"MAX_BUCKETS", BT_MAX_BUCKETS},
        {"DEFAULT_DRAIN_THRESHOLD", BT_DEFAULT_DRAIN_THRESHOLD},
        {"MIN_DRAIN_THRESHOLD", BT_MIN_DRAIN_THRESHOLD},
        {"DEFAULT_SWEEP_MIN", BT_DEFAULT_SWEEP_MIN},
        {"HIST_BUCKETS", BT_HIST_BUCKETS},
    };
    for (size_t i = 0; i < sizeof(constants) / sizeof(constants[0]); i++)
        if (PyModule_AddIntConstant(m, constants[i].name, constants[i].value) < 0) return -1;
    PyObject *range = PyFloat_FromDouble(BT_SECONDS_RANGE);
    int rc = PyModule_AddObjectRef(m, "SECONDS_RANGE", range); /* -1 if range is NULL */
    Py_XDECREF(range);
    return rc;
}

static int module_exec(PyObject *m) {
    ext_state *st = ext_state_of_module(m);
    ext_freelist_init(&st->handles, st->handle_store, HANDLE_FREELIST, 1);
    ext_freelist_init(&st->timeouts, st->timeout_store, TIMEOUT_FREELIST, 1);
    ext_freelist_init(&st->steps, st->step_store, STEP_FREELIST, 1);
    if (intern_names(st) < 0 || add_types(m, st) < 0 || import_asyncio(st) < 0 ||
        ext_compat_init(&st->compat) < 0 || ext_add_loop_attrs(m) < 0)
        return -1;
    return add_constants(m);
}

/* ---- traverse, clear, free ------------------------------------------------------ */

#define VISIT_STATE(field) Py_VISIT(st->field);
#define CLEAR_STATE(field) Py_CLEAR(st->field);
#define CLEAR_NAME(field, text) Py_CLEAR(st->field);

static int module_traverse(PyObject *m, visitproc visit, void *arg) {
    ext_state *st = ext_state_of_module(m);
    EXT_STATE_TYPES(VISIT_STATE)
    if (ext_compat_traverse(&st->compat, visit, arg)) return -1;
    EXT_STATE_OBJECTS(VISIT_STATE)
    return 0;
}

static int module_clear(PyObject *m) {
    ext_state *st = ext_state_of_module(m);
    /* The free lists first: what they keep is of the types below. */
    ext_freelist_clear(&st->handles);
    ext_freelist_clear(&st->timeouts);
    ext_freelist_clear(&st->steps);
    EXT_STATE_TYPES(CLEAR_STATE)
    ext_compat_clear(&st->compat);
    EXT_STATE_OBJECTS(CLEAR_STATE)
    st->time_checked_type = NULL;
    EXT_STATE_NAMES(CLEAR_NAME)
    return 0;
}

static void module_free(void *m) { module_clear((PyObject *)m); }

/* No Py_mod_gil slot: a free-threaded CPython turns the GIL back on when
 * it imports this module, and says so.  docs/design.rst ("Free threading")
 * lists what would have to change first. */
static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL}};

struct PyModuleDef ext_module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "bucketimer._core",
    .m_doc = "The CPython module over bucketimer's native timer core.",
    .m_size = sizeof(ext_state),
    .m_methods = module_functions,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__core(void) { return PyModuleDef_Init(&ext_module_def); }
