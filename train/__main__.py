# Everything under the guard, imports included: Composer's S3 uploader starts its worker processes (and a
# multiprocessing Manager) with the `spawn` method, which re-imports the main module in each child. With the
# CLI's imports at the top, every such child loaded the whole CLI (~5 s of imports on 2 cores) before its
# first upload, on every rank; an unguarded call would start the CLI again there.
if __name__ == "__main__":
    from shared.launch.control import adopt_agent_node_rank
    from shared.runtime.exits import main
    from train.cli import app

    adopt_agent_node_rank()  # several nodes: the rendezvous' node numbering, not the launcher's
    main(app, "python -m train")
