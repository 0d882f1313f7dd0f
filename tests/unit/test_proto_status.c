/*
 * test_proto_status.c — the one error space (rope/error.h) against the wire's
 * Status enum as protoc-c generated it: every Status has its code, with the
 * same name, and back; codes never collide with -errno; the tables are
 * complete and the message helpers follow the convention.
 */
#include <criterion/criterion.h>

#include <errno.h>
#include <string.h>

#include "kvrope.pb-c.h"
#include "rope/error.h"

Test(proto_status, every_status_has_its_code)
{
    const ProtobufCEnumDescriptor *d = &kvrope__status__descriptor;
    cr_assert_gt(d->n_values, 20);
    for (unsigned i = 0; i < d->n_values; i++) {
        int s = d->values[i].value;
        int code = kvr_error_from_status(s);
        cr_assert_neq(code, KVR_EPROTO, "Status %s has no KVR_E code", d->values[i].name);
        cr_assert_eq(kvr_error_status(code), s);
        cr_assert_eq(code, KVR_E_FROM_STATUS(s));
        cr_assert_str_eq(kvr_error_status_name(code), d->values[i].name);
    }
    cr_assert_eq(kvr_error_from_status(9999), KVR_EPROTO);   /* from a newer daemon */
}

Test(proto_status, codes_are_complete_and_apart_from_errno)
{
    size_t n = 0;
    const int *codes = kvr_error_codes(&n);
    cr_assert_eq(codes[0], KVR_OK);
    /* + the 5 local: libkvrope's 4 and KVR_EFETCH (the store's to the daemon) */
    cr_assert_eq(n, (size_t)kvrope__status__descriptor.n_values + 5);
    for (size_t i = 0; i < n; i++) {
        int c = codes[i];
        cr_assert(c == 0 || c < -4096, "%d is in errno's range", c);
        cr_assert_neq(strcmp(kvr_strerror(c), "unknown error"), 0);
        cr_assert_eq(strncmp(kvr_error_name(c), "KVR_", 4), 0);
        for (size_t j = 0; j < i; j++)
            cr_assert_neq(codes[j], c);
    }
    /* The old collisions: -ENOMEM, -EACCES, -EINVAL are not KVR codes. */
    cr_assert_str_eq(kvr_strerror(-ENOMEM), "unknown error");
    cr_assert_str_eq(kvr_strerror(-EACCES), "unknown error");
    cr_assert_str_eq(kvr_error_name(-EINVAL), "KVR_EUNKNOWN");
    cr_assert_str_eq(kvr_error_name(KVR_ENOCTX), "KVR_ENOCTX");
    cr_assert_str_eq(kvr_strerror(KVR_ENOMEM), "out of memory (or the memory cap cannot be met)");
    /* Local codes never travel: they are sent as E_INTERNAL. */
    cr_assert_eq(kvr_error_status(KVR_ESYS), KVROPE__STATUS__E_INTERNAL);
    cr_assert_null(kvr_error_status_name(KVR_EBUFFER));
    cr_assert_null(kvr_error_status_name(KVR_EFETCH));
    cr_assert_eq(kvr_error_status(-ENOMEM), KVROPE__STATUS__E_INTERNAL);
    cr_assert_eq(kvr_error_status(KVR_OK), KVROPE__STATUS__OK);
}

Test(proto_status, error_sys_maps_enomem_and_appends_strerror)
{
    kvr_error e = { 0 };
    cr_assert_eq(kvr_error_sys(&e, KVR_EIO, ENOENT, "open %s", "/x"), KVR_EIO);
    cr_assert_eq(e.code, KVR_EIO);
    cr_assert_str_eq(e.msg, "open /x: No such file or directory");
    cr_assert_eq(kvr_error_sys(&e, KVR_EIO, ENOMEM, "read"), KVR_ENOMEM);
    cr_assert_eq(e.code, KVR_ENOMEM);
    cr_assert_eq(kvr_error_sys(NULL, KVR_ESYS, EPIPE, "send"), KVR_ESYS);
    cr_assert_eq(kvr_error_set(&e, KVR_EBUSY, "ctx %d", 3), KVR_EBUSY);
    cr_assert_str_eq(e.msg, "ctx 3");
}
