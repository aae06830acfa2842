/*
 * The headers stag's rdma-core plugin is built against.
 *
 * Public API: the installed <infiniband/verbs.h> and <rdma/rdma_cma.h>.
 *
 * Private provider ABI: libibverbs' driver.h is not installed by Debian, so
 * the few structures a provider shares with libibverbs are declared here, as
 * rdma-core v44..v56 lay them out (IBVERBS_PRIVATE_34). Only the layout
 * matters; the names follow rdma-core's so that a reader can check them
 * against libibverbs/driver.h. `tests/abi.rs` pins the offsets the plugin
 * relies on.
 */
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

/* ccan/list.h's node: two pointers. */
struct stag_list_node {
	struct stag_list_node *next, *prev;
};

struct verbs_match_ent {
	void *driver_data;
	union {
		const char *modalias;
		uint64_t driver_id;
	} u;
	uint16_t vendor;
	uint16_t device;
	uint8_t kind;
};

/* A device as libibverbs found it in sysfs (or netlink). */
struct verbs_sysfs_dev {
	struct stag_list_node entry;
	void *provider_data;
	const struct verbs_match_ent *match;
	unsigned int flags;
	char sysfs_name[IBV_SYSFS_NAME_MAX];
	dev_t sysfs_cdev;
	char ibdev_name[IBV_SYSFS_NAME_MAX];
	char ibdev_path[IBV_SYSFS_PATH_MAX];
	char modalias[512];
	uint64_t node_guid;
	uint32_t driver_id;
	enum ibv_node_type node_type;
	int ibdev_idx;
	uint32_t num_ports;
	uint32_t abi_ver;
	struct timespec time_created;
};

struct verbs_device;

struct verbs_device_ops {
	const char *name;
	uint32_t match_min_abi_version;
	uint32_t match_max_abi_version;
	const struct verbs_match_ent *match_table;
	const struct verbs_device_ops **static_providers;
	bool (*match_device)(struct verbs_sysfs_dev *sysfs_dev);
	struct verbs_context *(*alloc_context)(struct ibv_device *device,
					       int cmd_fd, void *private_data);
	struct verbs_context *(*import_context)(struct ibv_device *device,
						int cmd_fd);
	struct verbs_device *(*alloc_device)(struct verbs_sysfs_dev *sysfs_dev);
	void (*uninit_device)(struct verbs_device *device);
};

struct verbs_device {
	struct ibv_device device; /* first */
	const struct verbs_device_ops *ops;
	atomic_int refcount;
	struct stag_list_node entry;
	struct verbs_sysfs_dev *sysfs;
	uint64_t core_support;
};

enum stag_mr_type {
	STAG_MR_TYPE_MR,
	STAG_MR_TYPE_NULL_MR,
	STAG_MR_TYPE_IMPORTED_MR,
	STAG_MR_TYPE_DMABUF_MR,
};

struct verbs_mr {
	struct ibv_mr ibv_mr;
	enum stag_mr_type mr_type;
	int access;
};

struct verbs_xrcd;

struct verbs_qp {
	union {
		struct ibv_qp qp;
		struct ibv_qp_ex qp_ex;
	};
	uint32_t comp_mask;
	struct verbs_xrcd *xrcd;
};

struct verbs_srq {
	struct ibv_srq srq;
	enum ibv_srq_type srq_type;
	struct verbs_xrcd *xrcd;
	struct ibv_cq *cq;
	uint32_t srq_num;
};

/*
 * Every op a provider may supply, in libibverbs' (alphabetical) order.
 * Pointers the plugin leaves NULL fall back to libibverbs' EOPNOTSUPP stubs
 * (verbs_set_ops copies only the non-NULL ones).
 */
struct verbs_context_ops {
	void *advise_mr;
	void *alloc_dm;
	void *alloc_mw;
	void *alloc_null_mr;
	void *alloc_parent_domain;
	struct ibv_pd *(*alloc_pd)(struct ibv_context *context);
	void *alloc_td;
	void (*async_event)(struct ibv_context *context, struct ibv_async_event *event);
	void *attach_counters_point_flow;
	int (*attach_mcast)(struct ibv_qp *qp, const union ibv_gid *gid, uint16_t lid);
	void *bind_mw;
	void *close_xrcd;
	void (*cq_event)(struct ibv_cq *cq);
	struct ibv_ah *(*create_ah)(struct ibv_pd *pd, struct ibv_ah_attr *attr);
	void *create_counters;
	struct ibv_cq *(*create_cq)(struct ibv_context *context, int cqe,
				    struct ibv_comp_channel *channel, int comp_vector);
	struct ibv_cq_ex *(*create_cq_ex)(struct ibv_context *context,
					  struct ibv_cq_init_attr_ex *init_attr);
	void *create_flow;
	void *create_flow_action_esp;
	struct ibv_qp *(*create_qp)(struct ibv_pd *pd, struct ibv_qp_init_attr *attr);
	struct ibv_qp *(*create_qp_ex)(struct ibv_context *context,
				       struct ibv_qp_init_attr_ex *qp_init_attr_ex);
	void *create_rwq_ind_table;
	struct ibv_srq *(*create_srq)(struct ibv_pd *pd, struct ibv_srq_init_attr *srq_init_attr);
	struct ibv_srq *(*create_srq_ex)(struct ibv_context *context,
					 struct ibv_srq_init_attr_ex *srq_init_attr_ex);
	void *create_wq;
	void *dealloc_mw;
	int (*dealloc_pd)(struct ibv_pd *pd);
	void *dealloc_td;
	int (*dereg_mr)(struct verbs_mr *vmr);
	int (*destroy_ah)(struct ibv_ah *ah);
	void *destroy_counters;
	int (*destroy_cq)(struct ibv_cq *cq);
	void *destroy_flow;
	void *destroy_flow_action;
	int (*destroy_qp)(struct ibv_qp *qp);
	void *destroy_rwq_ind_table;
	int (*destroy_srq)(struct ibv_srq *srq);
	void *destroy_wq;
	int (*detach_mcast)(struct ibv_qp *qp, const union ibv_gid *gid, uint16_t lid);
	void (*free_context)(struct ibv_context *context);
	void *free_dm;
	int (*get_srq_num)(struct ibv_srq *srq, uint32_t *srq_num);
	void *import_dm;
	void *import_mr;
	void *import_pd;
	int (*modify_cq)(struct ibv_cq *cq, struct ibv_modify_cq_attr *attr);
	void *modify_flow_action_esp;
	int (*modify_qp)(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask);
	void *modify_qp_rate_limit;
	int (*modify_srq)(struct ibv_srq *srq, struct ibv_srq_attr *srq_attr, int srq_attr_mask);
	void *modify_wq;
	void *open_qp;
	void *open_xrcd;
	int (*poll_cq)(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);
	int (*post_recv)(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr);
	int (*post_send)(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr);
	void *post_srq_ops;
	int (*post_srq_recv)(struct ibv_srq *srq, struct ibv_recv_wr *recv_wr,
			     struct ibv_recv_wr **bad_recv_wr);
	int (*query_device_ex)(struct ibv_context *context,
			       const struct ibv_query_device_ex_input *input,
			       struct ibv_device_attr_ex *attr, size_t attr_size);
	void *query_ece;
	int (*query_port)(struct ibv_context *context, uint8_t port_num,
			  struct ibv_port_attr *port_attr);
	int (*query_qp)(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask,
			struct ibv_qp_init_attr *init_attr);
	void *query_qp_data_in_order;
	void *query_rt_values;
	int (*query_srq)(struct ibv_srq *srq, struct ibv_srq_attr *srq_attr);
	void *read_counters;
	void *reg_dm_mr;
	void *reg_dmabuf_mr;
	struct ibv_mr *(*reg_mr)(struct ibv_pd *pd, void *addr, size_t length,
				 uint64_t hca_va, int access);
	int (*req_notify_cq)(struct ibv_cq *cq, int solicited_only);
	void *rereg_mr;
	int (*resize_cq)(struct ibv_cq *cq, int cqe);
	void *set_ece;
	void *unimport_dm;
	void *unimport_mr;
	void *unimport_pd;
};

/* libibverbs' private entry points (IBVERBS_PRIVATE_34). */
void verbs_register_driver_34(const struct verbs_device_ops *ops);
void *_verbs_init_and_alloc_context(struct ibv_device *device, int cmd_fd,
				    size_t alloc_size,
				    struct verbs_context *context_offset,
				    uint32_t driver_id);
void verbs_uninit_context(struct verbs_context *context);
void verbs_set_ops(struct verbs_context *vctx, const struct verbs_context_ops *ops);
void verbs_init_cq(struct ibv_cq *cq, struct ibv_context *context,
		   struct ibv_comp_channel *channel, void *cq_context);
