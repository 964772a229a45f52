/* ============================================================================
 * libfabric transport (skeleton): provider discovery. The tagged-message endpoints, the
 * rendezvous store and the collectives arrive with the distributed-core issue.
 * Build: cc -c dtrain_comm.c -DDTR_USE_LIBFABRIC $(pkg-config --cflags libfabric), link
 * $(pkg-config --libs libfabric). Without DTR_USE_LIBFABRIC it compiles to stubs that
 * return DTR_UNSUPPORTED.
 * ==========================================================================*/
#include "../public/api.h"
#include "../core/internal.h"

#ifdef DTR_USE_LIBFABRIC
#include <rdma/fabric.h>

dtr_result dtr_fabric_providers(char *buf, size_t len) {
    struct fi_info *hints, *info = NULL, *cur;
    size_t used = 0;
    int rc;
    if (!buf || !len) return DTR_NULL_HANDLE;
    buf[0] = 0;
    hints = fi_allocinfo();
    if (!hints) return DTR_OUT_OF_MEMORY;
    hints->ep_attr->type = FI_EP_RDM;
    hints->caps = FI_MSG | FI_TAGGED;
    rc = fi_getinfo(FI_VERSION(1, 9), NULL, NULL, 0, hints, &info);
    fi_freeinfo(hints);
    if (rc == -FI_ENODATA) return DTR_NOT_FOUND;
    if (rc) return DTR_UNSUPPORTED;
    for (cur = info; cur; cur = cur->next) {
        const char *name = cur->fabric_attr->prov_name;
        if (strstr(buf, name)) continue; /* one line per provider */
        used += (size_t)snprintf(buf + used, used < len ? len - used : 0, "%s%s", used ? "\n" : "", name);
        if (used >= len) { buf[len - 1] = 0; break; }
    }
    fi_freeinfo(info);
    return DTR_OK;
}
#else
dtr_result dtr_fabric_providers(char *buf, size_t len) {
    if (buf && len) buf[0] = 0;
    return DTR_UNSUPPORTED;
}
#endif
